"""A program's entries as plain values for the pictures and documents of ``kvlc pair``.

:class:`~kvlc.compiler.pairing.pair.TransferProgram` entries carry head-slice *pieces* and per-tile
*runs*; these two functions read them as ``(field, h0, h1)`` and ``(local sub-block, local
offset, remote sub-block, remote offset, length)`` tuples, whether the program stores them as
named records or as tuples, so that explain does not depend on how the compiler spells them.
"""

from __future__ import annotations


def piece(p) -> tuple[str, int, int]:
    """``(field, h0, h1)`` of one piece (``h0 == h1``: a replicated field, no head dim).

    >>> from kvlc import compile_spec, pair
    >>> p = compile_spec("layouts/llama-3.1-70b-hnd-tp4.yaml")
    >>> [piece(x) for x in pair(p, compile_spec("layouts/llama-3.1-70b-hnd-tp8.yaml"), local_rank=0).entries[0].pieces]
    [('k', 0, 1), ('v', 0, 1)]
    """
    if hasattr(p, "field"):
        return p.field, p.h0, p.h1
    name, (h0, h1), _, _ = p
    return name, h0, h1


def runs(r) -> list[tuple[int, int, int, int, int]]:
    """The runs of one tile as ``(local sub-block, local offset, remote sub-block, remote offset, length)``.

    >>> from kvlc import compile_spec, pair
    >>> p = compile_spec("layouts/llama-3.1-8b.yaml")
    >>> runs(pair(p, p, local_rank=0).entries[0].runs)
    [(0, 0, 0, 0, 65536)]
    """
    if hasattr(r, "local_block"):
        cols = (r.local_block, r.local_offset, r.remote_block, r.remote_offset, r.length)
    else:
        cols = tuple(r)
    return [tuple(int(v) for v in row) for row in zip(*(c.tolist() for c in cols))]
