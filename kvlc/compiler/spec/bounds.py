"""Bounds a whole spec must keep before any pass runs: expansion count and address space.

Each integer of a spec is bounded by its field (:mod:`kvlc.compiler.spec.models`); these checks bound
what they multiply to, from above and without resolving geometry:

* ``repeat`` expansions: at most :data:`MAX_EXPANDED` regions and storages in all;
* addresses: every byte a region can reach, summed over all regions with their repeats, with
  heads at their global count and token dims at the largest block size, stays below 2**63 — so
  no storage, offset or region end of the compiled plan can pass int64 at the runtime boundary.

Both are upper bounds: a spec they refuse would need more than 2**63 bytes, or more expanded
entries than any engine has layers times fields.
"""

from __future__ import annotations

from math import prod

from kvlc.compiler.spec.dtypes import field_bytes

MAX_EXPANDED = 1 << 16
ADDRESS_LIMIT = 1 << 63


def repeat_count(rng, spec) -> int:
    """How many values a repeat's ``range`` / ``values`` takes (an upper bound for ``layers``)."""
    if rng.values is not None:
        return len(rng.values)
    if rng.range == "layers":
        layers = spec.parallel.layers
        return (layers[1] - layers[0]) if layers else spec.model.num_layers
    start, stop, *step = rng.range
    return max(0, -(-(stop - start) // (step[0] if step else 1)))


def _dim_bound(dim, known: dict, tokens: int) -> int:
    if dim.sections:
        return sum(dim.sections.values())
    if isinstance(dim.size, int):
        return dim.size
    name = dim.size if isinstance(dim.size, str) else dim.name
    if name in known:
        return known[name]
    return tokens if dim.role == "token" else 1  # unknown sizes are reported by the passes


def block_bound(layout, spec, tokens: int) -> int:
    """At most how many bytes one block of ``layout`` spans."""
    known = spec.model.known_sizes()
    ends = [(f.offset or 0) + field_bytes(f.dtype, prod(_dim_bound(d, known, tokens) for d in f.dims))
            for f in layout.fields]
    packed = sum(field_bytes(f.dtype, prod(_dim_bound(d, known, tokens) for d in f.dims))
                 for f in layout.fields)
    return max([layout.size or 0, packed, *ends])


def _entries(entries, key: str, spec, path: tuple, times: int, repeat: tuple | None = None):
    """(item, path, multiplicity, path of its innermost repeat) for every plain entry."""
    for i, e in enumerate(entries):
        if getattr(e, "kind", None) == "repeat":
            times_here = times * repeat_count(e.repeat, spec)
            yield from _entries(getattr(e, key), key, spec, path + (i, key), times_here, path + (i, "repeat"))
        else:
            yield e, path + (i,), times, repeat


def check_spec_bounds(spec, spec_error) -> None:
    """Raise ``spec_error(...)`` when expansions or addresses of ``spec`` can exceed the limits."""
    storages = list(_entries(spec.storages, "storages", spec, ("storages",), 1))
    regions = list(_entries(spec.regions, "regions", spec, ("regions",), 1))
    _check_expansion(storages + regions, spec_error)
    _check_addresses(spec, storages, regions, spec_error)


def _check_expansion(entries: list, spec_error) -> None:
    expanded = sum(e[2] for e in entries)
    if expanded > MAX_EXPANDED:
        _, path, times, repeat = max(entries, key=lambda e: e[2])
        raise spec_error("repeats expand to too many entries",
                         expected=f"at most {MAX_EXPANDED:,} regions and storages after expanding repeats",
                         found=f"{expanded:,} ({times:,} from this entry)",
                         fix="check the repeat ranges (range: layers, or [start, stop])", at=repeat or path)


def _largest_tokens(spec) -> int:
    """The most tokens any block of the spec holds (spec, kernel and group block sizes)."""
    return max([spec.block_size, spec.kernel_block_size or 0]
               + [g.block_size or 0 for g in spec.groups] + [g.kernel_block_size or 0 for g in spec.groups])


def _region_span(r, times: int, block: int, aligns: int) -> int:
    """The most bytes ``times`` copies of region ``r`` can reach, with blocks of at most ``block`` bytes."""
    stride = r.block_stride if isinstance(r.block_stride, int) else block
    offset = r.offset if isinstance(r.offset, int) else 0
    return times * (offset + r.num_blocks * max(stride, block) + aligns)


def _check_addresses(spec, storages: list, regions: list, spec_error) -> None:
    tokens = _largest_tokens(spec)
    aligns = max([e[0].align for e in storages], default=1)
    largest = max((block_bound(lay, spec, tokens) for lay in spec.layouts.values()), default=0)
    total, worst = 0, (0, ())
    for r, path, times, _ in regions:
        layout = spec.layouts.get(r.layout)
        block = block_bound(layout, spec, tokens) if layout is not None else largest
        span = _region_span(r, times, block, aligns)
        total += span
        worst = max(worst, (span, path))
    if total >= ADDRESS_LIMIT:
        raise spec_error("regions can reach past 2**63 bytes", expected="every offset and region end below "
                         f"2**63 = {ADDRESS_LIMIT:,} (int64 addresses)",
                         found=f"up to {total:,} bytes over all regions", at=worst[1] + ("num_blocks",),
                         fix="lower num_blocks (or block_stride / offset) of this region")
