"""The region overlap check is exact when strides differ (brute force over every byte agrees),
and regions whose different strides interleave without sharing a byte now compile."""

from __future__ import annotations

from types import SimpleNamespace

import yaml
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.plan.overlap import first_shared_byte


def region(draw):
    return SimpleNamespace(offset=draw(st.integers(0, 200)), block_stride=draw(st.integers(1, 60)),
                           block_bytes=draw(st.integers(1, 40)), num_blocks=draw(st.integers(1, 40)))


def byte_set(r) -> set:
    return {r.offset + i * r.block_stride + k for i in range(r.num_blocks) for k in range(r.block_bytes)}


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_first_shared_byte_is_exact(data):
    a, b = region(data.draw), region(data.draw)
    if a.block_bytes > a.block_stride or b.block_bytes > b.block_stride:
        return
    common = byte_set(a) & byte_set(b)
    got = first_shared_byte(a, b)
    event("shared" if common else "disjoint")
    if common:
        assert got in common
    else:
        assert got is None


def test_large_regions_use_the_period():
    """2**30 blocks each: decided from one period and the ends, exactly."""
    a = SimpleNamespace(offset=0, block_stride=128, block_bytes=32, num_blocks=2**30)
    b = SimpleNamespace(offset=32, block_stride=64, block_bytes=32, num_blocks=2**31)
    assert first_shared_byte(a, b) is None
    c = SimpleNamespace(offset=96, block_stride=96, block_bytes=32, num_blocks=2**30)
    byte = first_shared_byte(a, c)
    assert byte is not None and byte % 128 < 32 and (byte - 96) % 96 < 32


def test_interleaved_regions_of_different_strides_compile():
    spec = {"kvlc": 1, "name": "tiny", "model": {"name": "m", "num_layers": 1, "sizes": {"d": 2}},
            "block_size": 4, "groups": [{"name": "full", "kind": "full_attention"}],
            "storages": [{"name": "kv", "mem": "VRAM"}],
            "layouts": {"s": {"fields": [{"name": "s", "dtype": "fp32",
                                          "dims": [{"name": "token", "role": "token"}, {"name": "d"}]}]}},
            "regions": [{"name": "a", "storage": "kv", "layout": "s", "num_blocks": 4, "groups": ["full"],
                         "offset": 0, "block_stride": 128},
                        {"name": "b", "storage": "kv", "layout": "s", "num_blocks": 4, "groups": ["full"],
                         "offset": 32, "block_stride": 64}]}
    plan = kvlc.compile_spec(yaml.safe_dump(spec))
    assert [(r.offset, r.block_stride) for r in plan.regions] == [(0, 128), (32, 64)]
    a, b = plan.regions
    ba = {a.offset + i * a.block_stride + k for i in range(4) for k in range(32)}
    bb = {b.offset + i * b.block_stride + k for i in range(4) for k in range(32)}
    assert not ba & bb
