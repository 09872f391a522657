"""vLLM 0.32's KV-cache groups under its hybrid manager (restated from ``kv_cache_utils``, not copied).

Layers are bucketed by kind in layer order; the group size is the smallest bucket (the largest
when it is under 1.5 times the smallest); a bucket of ``n`` layers makes ``ceil(n / size)``
groups, group ``i`` taking every ``ceil(n / size)``-th layer from ``i``. The ``k``-th layers of
all groups then share one page pool. The same rule groups attention kinds (sliding window and
full: Gemma-3, gpt-oss) and state kinds (Mamba-2, Gated DeltaNet).

>>> vllm_groups([(0, "sliding"), (1, "sliding"), (2, "sliding"), (3, "full")])
[('sliding', (0,)), ('sliding', (1,)), ('sliding', (2,)), ('full', (3,))]
"""

from __future__ import annotations

from collections.abc import Sequence


def vllm_groups(layers: Sequence[tuple[int, str]]) -> list[tuple[str, tuple[int, ...]]]:
    """vLLM's KV-cache groups of ``(layer index, kind)`` pairs: ``[(kind, layer indices)]`` in group order."""
    buckets: dict[str, list[int]] = {}
    for index, kind in layers:
        buckets.setdefault(kind, []).append(index)
    sizes = [len(v) for v in buckets.values()]
    size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    out = []
    for kind, members in buckets.items():
        n = -(-len(members) // size)
        out.extend((kind, tuple(members[i::n])) for i in range(n))
    return out
