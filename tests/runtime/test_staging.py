"""Staging through bounce buffers: chunking keeps every byte's pairing, gather/scatter copy exactly the
ranges given, the protocol's messages are validated, and two real NIXL agents in two processes move
content-coded bytes through bounded DRAM bounce buffers (every destination byte checked, nothing else
written)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlc.errors import KvlcError
from kvlc.runtime.staging.endpoint import StagingPolicy, split_chunks
from kvlc.runtime.staging.copy import Copier, Regions, StagingError
from kvlc.runtime.staging.wire import BounceInfo, Kind, Message, decode, encode, is_staging

torch = pytest.importorskip("torch")


def _expand(rows: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(a, a + n, dtype=np.uint64) for a, n in rows.tolist()])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 200), st.integers(1, 7))
def test_split_chunks_keeps_every_byte_pairing(lens, slot, max_rows):
    """Chunks hold at most slot bytes and max_rows rows, and byte i of the source still goes to byte i of
    the destination, in order."""
    lens = np.array(lens, dtype=np.uint64)
    src = np.stack([np.cumsum(lens + 5) * 3, lens], axis=1).astype(np.uint64)
    dst = np.stack([np.cumsum(lens + 11) * 7 + 10**6, lens], axis=1).astype(np.uint64)
    chunks = split_chunks(src, dst, slot, max_rows)
    assert all(int(a[:, 1].sum()) <= slot and len(a) <= max_rows for a, _ in chunks)
    got_src = np.concatenate([_expand(a) for a, _ in chunks])
    got_dst = np.concatenate([_expand(b) for _, b in chunks])
    assert np.array_equal(got_src, _expand(src)) and np.array_equal(got_dst, _expand(dst))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_gather_then_scatter_copies_exactly_the_ranges(data):
    """Random non-overlapping ranges over several regions (any alignment, equal or mixed lengths): gather
    packs them in order, scatter puts them back at other ranges, and no other byte changes."""
    sizes = [4096, 8192, 1024]
    src = [torch.from_numpy(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)) for i, n in enumerate(sizes)]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    length = data.draw(st.sampled_from([8, 16, 24, 64, 3, 2]))
    mixed = data.draw(st.booleans())
    rows_s, rows_d = [], []
    for r, n in enumerate(sizes):
        slots = n // 64
        picks_s = data.draw(st.lists(st.integers(0, slots - 2), unique=True, max_size=12))
        picks_d = data.draw(st.permutations(range(slots)))[:len(picks_s)]
        shift = data.draw(st.integers(0, 64 - 48))  # unaligned starts too
        for a, b in zip(picks_s, picks_d):
            n_ = length if not mixed else data.draw(st.integers(1, 40))
            rows_s.append((src[r].data_ptr() + a * 64 + shift, n_))
            rows_d.append((dst[(r + 1) % 3].data_ptr() + b * 64 if sizes[(r + 1) % 3] > b * 64 + 64
                           else dst[r].data_ptr() + b * 64, n_))
    if not rows_s:
        return
    rs, rd = np.array(rows_s, dtype=np.uint64), np.array(rows_d, dtype=np.uint64)
    bounce = torch.zeros(int(rs[:, 1].sum()) + 16, dtype=torch.uint8)
    Copier(Regions.of_tensors(src)).gather(rs, bounce)
    everything = {t.data_ptr(): t.numpy() for t in src}
    expect = np.concatenate([_bytes(everything, a, n) for a, n in rs.tolist()])
    assert np.array_equal(bounce[:len(expect)].numpy(), expect)
    before = [t.clone() for t in dst]
    Copier(Regions.of_tensors(dst)).scatter(bounce, rd)
    want = [t.numpy().copy() for t in before]
    at = 0
    for a, n in rd.tolist():
        i = next(i for i, t in enumerate(dst) if t.data_ptr() <= a < t.data_ptr() + t.numel())
        want[i][a - dst[i].data_ptr():a - dst[i].data_ptr() + n] = expect[at:at + n]
        at += n
    for t, w in zip(dst, want):
        assert np.array_equal(t.numpy(), w)


def _bytes(regions: dict, addr: int, n: int) -> np.ndarray:
    base = max(b for b in regions if b <= addr)
    return regions[base][addr - base:addr - base + n]


def test_ranges_outside_regions_are_refused():
    """A range outside every registered region is a StagingError naming the range, before any copy."""
    t = torch.zeros(100, dtype=torch.uint8)
    regs = Regions.of_tensors([t])
    with pytest.raises(StagingError, match="lies outside every registered region"):
        Copier(regs).scatter(torch.ones(64, dtype=torch.uint8), np.array([[t.data_ptr() + 90, 20]], dtype=np.uint64))
    assert int(t.sum()) == 0


def test_ranges_that_wrap_past_2_64_are_refused():
    """A range whose end wraps past 2**64 (so that addr + len looks small) is outside, not inside;
    nothing is copied (issue 27, F1)."""
    t = torch.zeros(100, dtype=torch.uint8)
    regs = Regions.of_tensors([t])
    base = t.data_ptr()
    for addr, n in ((base + 10, (1 << 64) - 5), (base, (1 << 64) - base + 20), (base + 99, (1 << 64) - 1)):
        with pytest.raises(StagingError, match="lies outside every registered region"):
            Copier(regs).scatter(torch.ones(64, dtype=torch.uint8), np.array([[addr, n]], dtype=np.uint64))
    assert int(t.sum()) == 0
    Copier(regs).scatter(torch.ones(100, dtype=torch.uint8), np.array([[base, 100]], dtype=np.uint64))
    assert int(t.sum()) == 100  # the whole region is still inside


@pytest.mark.parametrize("raw, words", [
    (b"KVS", "truncated"),
    (b"KVSX" + bytes(25), "not a staging message"),
    (encode(Message(Kind.FREE, "r1"))[:4] + bytes([9]) + encode(Message(Kind.FREE, "r1"))[5:], "unknown kind"),
    (encode(Message(Kind.LANDED, "r1", 0, 1, 0, nbytes=2, nrows=1))[:-3], "payload bytes, expected 12"),
    (encode(Message(Kind.LANDED, "r1", 3, 1, 0, nbytes=2, nrows=1)), "chunk 3 of 1"),
    (encode(Message(Kind.LANDED, "r1", 0, 1, 0, nbytes=2, nrows=9000)), "1..8192 ranges"),
    (encode(Message(Kind.FREE, "r1")) + b"x", "unexpected payload"),
])
def test_bad_messages_are_refused(raw, words):
    """Malformed staging notifications are StagingErrors that say what is wrong."""
    with pytest.raises(StagingError, match=words):
        decode(raw)


def test_messages_round_trip_and_bounce_info_is_validated():
    """LANDED/FREE/FAIL survive encode/decode; a peer's bounce description is checked key by key."""
    m = decode(encode(Message(Kind.FAIL, "req-9", reason="gone")))
    assert (m.kind, m.req, m.reason) == (Kind.FAIL, "req-9", "gone")
    assert is_staging(encode(m)) and not is_staging(b'{"v":1}')
    info = BounceInfo("a", 4096, 1024, 1 << 20, 4, "VRAM", 0)
    assert BounceInfo.from_dict(info.to_dict()) == info
    with pytest.raises(StagingError, match="'slots' must be int"):
        BounceInfo.from_dict(dict(info.to_dict(), slots="4"))
    with pytest.raises(StagingError, match="mem DRAM|VRAM"):
        BounceInfo.from_dict(dict(info.to_dict(), mem="HBM"))
    with pytest.raises(StagingError, match="no room for the ranges"):
        BounceInfo.from_dict(dict(info.to_dict(), stride=2048))


def test_policy_gates_by_count_mean_size_and_memory_types():
    """auto: fragmented (many small) or mixed-memory parts are staged, large contiguous ones not;
    always/never override; bad settings are KvlcErrors."""
    p = StagingPolicy()
    assert p.decide(4086, 4086 << 16, "VRAM", "VRAM")
    assert not p.decide(32, 256 << 20, "VRAM", "VRAM")
    assert p.decide(32, 256 << 20, "DRAM", "VRAM")
    assert not p.decide(100, 100 << 10, "VRAM", "VRAM")
    assert StagingPolicy(mode="always").decide(1, 1 << 30, "VRAM", "VRAM")
    assert not StagingPolicy(mode="never").decide(10**5, 10**5, "DRAM", "VRAM")
    with pytest.raises(KvlcError, match="use one of"):
        StagingPolicy(mode="sometimes")
    with pytest.raises(KvlcError, match="positive integer"):
        StagingPolicy(min_descriptors=0)


@pytest.mark.runtime
def test_two_processes_stage_content_coded_bytes_through_small_buffers():
    """Real NIXL agents in two processes: fragmented and contiguous requests stream through 2 slots of
    64 KiB (far smaller than a request, so credits and chunk boundaries are exercised); every destination
    byte is checked and every other byte is unchanged; then a request whose destination lies outside the
    receiver's regions fails on both sides (refused by the receiver) and writes nothing."""
    pytest.importorskip("nixl")
    from testkit.staging_pair import Pair, Ranges, Side, fragmented

    sender = Side(regions=(1 << 20, 1 << 20), slot_bytes=64 << 10, slots=2)
    receiver = Side(regions=(1 << 20, 1 << 20, 1 << 19), slot_bytes=64 << 10, slots=2)
    pair = Pair(sender, receiver)
    try:
        frag = fragmented(2, 3, 600, 1024, 512, seed=1)
        odd = Ranges(np.array([[0, 3, 200_001], [1, 7, 99]]), np.array([[2, 5, 200_001], [1, 1 << 19, 99]]))
        s, r = pair.staged([frag, odd])
        assert s["failed"] == {} and r["failed"] == {} and r["received"] == 2
        assert s["stats"]["bytes_sent"] == frag.nbytes + odd.nbytes
        checked = pair.check([frag, odd])
        assert checked["mismatches"] == [] and checked["checked_bytes"] == (5 << 19)
        outside = Ranges(np.array([[0, 0, 4096]]), np.array([[2, (1 << 19) - 100, 4096]]))
        s, r = pair.staged([outside], timeout=3.0)
        assert "outside every registered region" in s["failed"]["b1-r0"] and "b1-r0" in r["failed"]
        assert pair.check([frag, odd])["mismatches"] == []
        s, r = pair.staged([frag])  # the refused chunk's slot came back: the pair still moves bytes
        assert s["failed"] == {} and r["received"] == 1 and pair.check([frag, odd])["mismatches"] == []
    finally:
        pair.stop()


@pytest.mark.runtime
def test_chunks_of_large_ranges_go_direct_and_land_exactly_like_gathered_ones():
    """Ranges of >= 1 MiB (cut at 2 MiB slot boundaries) are written from the sender's regions straight
    into the receiver's slots, small ones in the same batch are gathered; every destination byte is its
    content code, nothing else changed; with ``direct_min_bytes=0`` the same requests are all gathered."""
    pytest.importorskip("nixl")
    from testkit.staging_pair import Pair, Ranges, Side, fragmented

    mib = 1 << 20
    big = Ranges(np.array([[0, 0, 3 * mib + 17], [1, 5 * mib, 2 * mib], [0, 4 * mib, mib + 4096]]),
                 np.array([[1, mib, 3 * mib + 17], [0, 0, 2 * mib], [2, 2 * mib, mib + 4096]]))
    small = fragmented(2, 2, 300, 2048, 256, seed=4, dst_region0=1)
    for direct_min, expect_direct in ((1 << 20, True), (0, False)):
        side = Side(regions=(8 * mib, 8 * mib, 4 * mib), slot_bytes=2 * mib, slots=2, direct_min_bytes=direct_min)
        pair = Pair(side, side)
        try:
            s, r = pair.staged([big, small])
            assert s["failed"] == {} and r["failed"] == {} and r["received"] == 2
            assert (s["stats"]["chunks_direct"] > 0) == expect_direct, s["stats"]
            assert s["stats"]["chunks_direct"] < s["stats"]["chunks_sent"]  # the small ranges' chunks were gathered
            checked = pair.check([big, small])
            assert checked["mismatches"] == [] and checked["checked_bytes"] == 20 * mib  # every receiver byte
        finally:
            pair.stop()


def test_ranges_of_several_regions_on_one_device_move_in_one_indexed_copy():
    """Equal-length ranges spread over three regions of one device: one view spans the regions, so a
    gather (and the scatter back) is ONE indexed copy, and the bytes are exactly the ranges' bytes."""
    src = [torch.from_numpy(np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8)) for i in range(3)]
    rows = np.array([(src[i % 3].data_ptr() + 64 * (7 * i % 60), 64) for i in range(24)], dtype=np.uint64)
    bounce = torch.zeros(24 * 64, dtype=torch.uint8)
    copier = Copier(Regions.of_tensors(src))
    copier.gather(rows, bounce)
    everything = {t.data_ptr(): t.numpy() for t in src}
    assert np.array_equal(bounce.numpy(), np.concatenate([_bytes(everything, a, n) for a, n in rows.tolist()]))
    assert copier.calls == 1
    dst = [torch.zeros(4096, dtype=torch.uint8) for _ in range(3)]
    back = Copier(Regions.of_tensors(dst))
    back.scatter(bounce, np.array([(dst[i % 3].data_ptr() + a - src[i % 3].data_ptr(), n)
                                   for i, (a, n) in enumerate(rows.tolist())], dtype=np.uint64))
    assert back.calls == 1
    want = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    for i, (a, n) in enumerate(rows.tolist()):
        off = a - src[i % 3].data_ptr()
        want[i % 3][off:off + n] = src[i % 3].numpy()[off:off + n]
    for d, w in zip(dst, want):
        assert np.array_equal(d.numpy(), w)


def test_an_endpoint_stays_hot_while_a_request_is_partly_received():
    """``hot`` (the progress thread's cue to poll every 50 us): busy, or chunks of an unfinished request
    arrived within HOT_S; a request whose sender went silent cools down after HOT_S."""
    from kvlc.runtime.staging.endpoint import StagingEndpoint

    now = [100.0]
    ep = StagingEndpoint(None, Regions([]), None, clock=lambda: now[0])
    assert not ep.busy and not ep.hot
    ep._receiving[("sender", "r1")] = {0}  # chunk 0 of r1 scattered, more to come
    ep._last_in = now[0]
    assert ep.hot and not ep.busy
    now[0] += ep.HOT_S * 0.9
    assert ep.hot
    now[0] += ep.HOT_S * 0.2
    assert not ep.hot
    del ep._receiving[("sender", "r1")]
    ep._last_in = now[0]
    assert not ep.hot  # nothing partly received: only busy work keeps it hot


def test_one_view_spans_regions_only_when_every_touched_region_is_on_the_bounce_device():
    """Ranges over several regions share one view (one indexed copy) only if each region they touch is
    on the bounce buffer's device; a range in a region elsewhere (here a "meta" tensor) turns it off."""
    from kvlc.runtime.staging.copy import Region

    a, b = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    top = max(a.data_ptr(), b.data_ptr()) + 4096
    elsewhere = Region(top + (1 << 30), 4096, torch.empty(4096, dtype=torch.uint8, device="meta"))
    regs = Regions([Region(a.data_ptr(), 4096, a), Region(b.data_ptr(), 4096, b), elsewhere])
    cp = Copier(regs)
    cpu = torch.device("cpu")
    on_cpu = regs.locate(np.array([[a.data_ptr(), 64], [b.data_ptr() + 64, 64]], dtype=np.uint64))
    assert cp._span(cpu, on_cpu) is not None
    assert cp._span(cpu, np.append(on_cpu, 2)) is None and cp._span(cpu, np.array([2, 2])) is None
