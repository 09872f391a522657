"""instantiate / check_request take only well-typed requests and refuse the rest with a TransferError."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.errors import TransferError
from kvlc import bind, check_request, instantiate

PLAN = kvlc.compile_spec("layouts/llama-3.1-8b.yaml")           # one group 'full', block 16 tokens
PULL = kvlc.pair(PLAN, PLAN, local_rank=0, direction="READ")    # local side receives
PUSH = kvlc.pair(PLAN, PLAN, local_rank=0, direction="WRITE")   # remote side receives
LB = {s.name: (i + 1) << 36 for i, s in enumerate(PLAN.storages)}
RB = {0: {s.name: (i + 64) << 36 for i, s in enumerate(PLAN.storages)}}


def request(prog, local, remote, tokens=32):
    return instantiate(bind(prog, LB, RB), {"full": local}, {"full": remote}, tokens)


def test_integer_lists_and_arrays_are_accepted():
    """Lists of int, tuples, ranges and integer numpy arrays (any int width) give the same descriptors."""
    want = request(PULL, [3, 5], [1, 2])
    for ids in ([3, 5], (3, 5), np.array([3, 5], dtype=np.int32), np.array([3, 5], dtype=np.uint16),
                [np.int64(3), np.int64(5)]):
        got = request(PULL, ids, [1, 2])
        assert {k: (p.local.tolist(), p.remote.tolist()) for k, p in got.items()} == \
            {k: (p.local.tolist(), p.remote.tolist()) for k, p in want.items()}


@pytest.mark.parametrize("ids, found", [
    ([2.7, 1], "float"), ([2.0, 1], "float"), ([True, 1], "bool"), (["3", 1], "str"), ([None, 1], "None"),
    (np.array([2.7, 1.0]), "dtype float64"), (np.array([True, False]), "dtype bool"), ("31", "str"),
    (None, "None"), (7, "int"), (np.array(["1", "2"]), "dtype <U1")])
def test_non_integer_ids_are_refused(ids, found):
    """Fractional, bool, string and None ids (and non-sequences) are refused, naming side, group and type."""
    for side in ("local", "remote"):
        local, remote = (ids, [0, 1]) if side == "local" else ([0, 1], ids)
        with pytest.raises(TransferError, match=f"{side} block ids of group 'full'.*{found}"):
            request(PULL, local, remote)
        with pytest.raises(TransferError):
            check_request(PULL, {"full": local}, {"full": remote}, 32)


@pytest.mark.parametrize("tokens", [2.5, 32.0, float("nan"), "32", None, True, [32]])
def test_non_integer_token_counts_are_refused(tokens):
    """num_tokens: NaN, fractional, float, string, None and bool are refused with a TransferError."""
    with pytest.raises(TransferError, match="num_tokens must be a positive integer"):
        request(PULL, [0, 1], [0, 1], tokens)
    with pytest.raises(TransferError, match="num_tokens must be a positive integer"):
        request(PULL, [0, 1], [0, 1], {"full": tokens})


def test_huge_ids_are_refused():
    """Ids past int64 or past the region capacity are refused before any descriptor."""
    for ids in ([1 << 70, 0], np.array([1 << 63, 0], dtype=np.uint64)):
        with pytest.raises(TransferError, match="too large"):
            request(PULL, ids, [0, 1])


def test_duplicate_ids_refused_on_the_receiving_side_only():
    """Pull: the local (receiving) ids must be distinct; the sent ids may repeat. Push: the reverse."""
    with pytest.raises(TransferError, match="local block ids of group 'full': block id 4 appears 2 times"):
        request(PULL, [4, 4], [0, 1])
    assert request(PULL, [4, 5], [1, 1])
    with pytest.raises(TransferError, match="remote block ids of group 'full': block id 1 appears 2 times"):
        request(PUSH, [4, 5], [1, 1])
    assert request(PUSH, [4, 4], [0, 1])


def test_unknown_groups_are_refused_with_a_hint():
    """A group name neither plan has is refused with did-you-mean (ids and token maps alike)."""
    with pytest.raises(TransferError, match="unknown group 'ful'.*did you mean 'full'"):
        instantiate(bind(PULL, LB, RB), {"ful": [0, 1], "full": [0, 1]}, {"full": [0, 1]}, 32)
    with pytest.raises(TransferError, match="remote block ids name unknown group 'swa'"):
        instantiate(bind(PULL, LB, RB), {"full": [0, 1]}, {"full": [0, 1], "swa": [0]}, 32)
    with pytest.raises(TransferError, match="must map group name"):
        instantiate(bind(PULL, LB, RB), [0, 1], {"full": [0, 1]}, 32)


def test_bases_that_would_wrap_are_refused():
    """A base address that puts a storage past 2**63 (or is negative, or not an integer) is refused at bind."""
    for bad in (1 << 63, (1 << 63) - 10, -1, 1.5, "0x10"):
        with pytest.raises(TransferError, match="storage 'kv.0'"):
            bind(PULL, {**LB, "kv.0": bad}, RB)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(-5, 40), st.floats(allow_nan=True), st.booleans(), st.text(max_size=2),
                          st.none()), min_size=0, max_size=4),
       st.one_of(st.integers(-3, 80), st.floats(allow_nan=True), st.text(max_size=2), st.none(), st.booleans()))
def test_any_request_either_works_or_raises_a_transfer_error(ids, tokens):
    """Whatever the ids and token count, instantiate returns parts or raises a TransferError, nothing else."""
    try:
        parts = request(PULL, ids, list(range(len(ids))), tokens)
    except TransferError:
        return
    assert all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    assert isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0
    assert sum(p.nbytes for p in parts.values()) > 0


@pytest.mark.parametrize("n", [5, 16, 128, 129, 300])
def test_few_and_many_ids_get_the_same_refusals(n):
    """Bounds and duplicates name the same id and count whether a side gives few ids or many (both paths)."""
    cap = PLAN.group_capacity("full")
    region = min((r for r in PLAN.regions if "full" in r.groups), key=lambda r: r.capacity).name
    ids = list(range(cap - n, cap))                      # n distinct ids, the last one at the capacity limit
    assert check_request(PULL, {"full": ids}, {"full": ids}, 16 * n)
    for bad in (-1, cap):
        with pytest.raises(TransferError) as e:
            check_request(PULL, {"full": ids[:-1] + [bad]}, {"full": ids}, 16 * n)
        assert str(e.value) == (f"local block id {bad} out of range for region '{region}' "
                                f"(group 'full', capacity {cap} blocks)")
    dup = ids[:-3] + [ids[1], ids[0], ids[0]]            # ids[0] three times, ids[1] twice: smallest id, most times
    with pytest.raises(TransferError) as e:
        check_request(PUSH, {"full": ids}, {"full": dup}, 16 * n)
    assert str(e.value) == (f"remote block ids of group 'full': block id {ids[0]} appears 3 times; "
                            "the receiving side writes each block once, so give distinct ids")
