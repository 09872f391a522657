"""Several requests of one connection submitted together: :meth:`Peer.write_many` / :meth:`Peer.read_many`.

An empty batch does nothing. Every request is checked first (ids, counts, bounds, not in flight,
not cancelled by the consumer); one refusal refuses the whole batch, naming the request, and
nothing is created or posted then. On a direct connection the requests' descriptors are then joined, part by part
(:func:`kvlc.compiler.pairing.program.join_parts`), into ONE NIXL request per part for all of them: the
per-request costs of creating, posting and polling NIXL requests are paid once per batch, and the
requests that end in the same progress turn share one ``done`` notification per session.

A batch moves and ends as one: its requests share one deadline, and a failure, a timeout or a
cancel of any of them fails every one (each consumer hears ``failed``, after no byte can land
any more). Where rows cannot be shared (a ``prepped`` connection, or a part the staging policy
sends through bounce buffers), the checked requests are submitted one by one instead; so they are
where the same-host copy moves the first request's every part on its own
(:meth:`KvAgent.copies_each`), and there every request's ids are checked first and its rows built
only just before it is submitted: one joined copy would start only after every request's rows were
built, while one copy per request starts as soon as its rows are and runs while the next is built
(measured on an H100: four random-id Llama handovers of 4k tokens at 0.67-0.69 of the
device-to-device copy joined, 0.86-0.92 one ``write()`` each). A ``pull_via_push`` connection checks
every request, then asks the producer for each.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvlc.compiler.pairing.program import join_parts
from kvlc.compiler.request.check import check_request
from kvlc.errors import TransferError
from kvlc.runtime.arguments import check_request_id, request_timeout
from kvlc.runtime.channel.notifs import agents_of
from kvlc.runtime.kinds import Direction, ConnectionMode
from kvlc.runtime.transfer import Member


@dataclass(frozen=True)
class BlockRequest:
    """One request of a batch: its id, each side's block ids per group, and the tokens it moves
    (``num_tokens=N`` for ``[0, N)``, or ``tokens=(start, stop)``), as :meth:`Peer.write` takes them.
    ``local_block_ids`` are this side's (the caller's) blocks."""

    request_id: str
    local_block_ids: Mapping[str, Sequence[int]]
    remote_block_ids: Mapping[str, Sequence[int]]
    num_tokens: int | Mapping[str, int] | None = None
    tokens: Any = None


def _items(requests: Iterable[BlockRequest]) -> list[BlockRequest]:
    items = list(requests)
    seen: set[str] = set()
    for i, it in enumerate(items):
        if not isinstance(it, BlockRequest):
            raise TransferError(f"batch item {i}: expected a kvlc.runtime.BlockRequest, found "
                                f"{type(it).__name__}; build one per request")
        try:
            check_request_id(it.request_id)
        except TransferError as exc:
            raise TransferError(f"batch item {i}: {exc}") from None
        if it.request_id in seen:
            raise TransferError(f"batch item {i}: request '{it.request_id}' appears twice in the batch")
        seen.add(it.request_id)
    return items


def _refused(peer, items: list[BlockRequest], op: str, verb: str) -> None:
    """Refuse the batch where a request is in flight or (WRITE) cancelled by its consumer."""
    a = peer.agent
    for i, it in enumerate(items):
        if a.is_moving((verb, it.request_id)) or (op == "READ" and it.request_id in a.incoming):
            raise TransferError(f"batch item {i}: request '{it.request_id}' is already in flight; nothing moved")
        if op == "WRITE":
            for key, why in peer.cancelled(it.request_id).items():
                if a.ended(key) is not None:
                    raise TransferError(f"batch item {i}: {why}")


def _named(i: int, it: BlockRequest, exc: TransferError) -> TransferError:
    return TransferError(f"batch item {i} (request '{it.request_id}'): {exc}; nothing moved")


def _built(peer, items: list[BlockRequest], checked: list | None = None) -> Iterator[tuple[dict, dict]]:
    """Each request's parts and staging decision (:meth:`Peer.parts`), built when asked for (from its
    checked ids where ``checked`` has them), or a refusal naming the request."""
    for i, it in enumerate(items):
        try:
            yield peer.parts(it.local_block_ids, it.remote_block_ids, it.num_tokens, it.tokens,
                             checked=None if checked is None else checked[i])
        except TransferError as exc:
            raise _named(i, it, exc) from None


def submit(peer, requests: Iterable[BlockRequest], direction: Direction, timeout: float | None) -> None:
    """:meth:`Peer.write_many` (``direction`` WRITE) and :meth:`Peer.read_many` (READ)."""
    verb = "write" if direction is Direction.WRITE else "read"
    if peer.direction is not direction:
        raise TransferError(f"{verb}_many() needs a connection made with direction='{direction.value}'")
    items = _items(requests)
    if not items:  # an engine step with nothing to move
        return
    a = peer.agent
    timeout = request_timeout(timeout, a.timeout)
    if peer.mode is ConnectionMode.PULL_VIA_PUSH:
        _ask_each(peer, items, timeout)
        return
    op = direction.value
    peer._live()
    _refused(peer, items, op, verb)
    if peer.mode is not ConnectionMode.DIRECT:  # prepared lists: nothing to share, each request built and submitted
        _one_by_one(peer, items, list(_built(peer, items)), op, verb, timeout)
        return
    # Every request's ids checked first (nothing built); the first request's parts say whether the
    # same-host copy moves it on its own: then each request is built just before it is submitted, so
    # its copy starts while the next one is built.
    checked = _checks(peer, items)
    built = _built(peer, items, checked)
    first = next(built)
    if len(items) == 1 or first[1] or a.copies_each([first[0]], agents_of(peer._targets())):
        _one_by_one(peer, items, itertools.chain([first], built), op, verb, timeout)
        return
    rest = [first, *built]
    if any(staged for _, staged in rest):
        _one_by_one(peer, items, rest, op, verb, timeout)
    else:
        _shared(peer, items, [p for p, _ in rest], op, verb, timeout)


def _checks(peer, items: list[BlockRequest]) -> list:
    """Each request's ids checked (:func:`check_request`), or a refusal naming the request."""
    out = []
    for i, it in enumerate(items):
        try:
            out.append(check_request(peer.program, it.local_block_ids, it.remote_block_ids, it.num_tokens,
                                     tokens=it.tokens))
        except TransferError as exc:
            raise _named(i, it, exc) from None
    return out


def _refusals(peer, items: list[BlockRequest], op: str) -> dict | None:
    """A WRITE is refused where a consumer rank cancelled one of its requests (see :meth:`Peer.cancelled`)."""
    if op != "WRITE":
        return None
    return {k: why for it in items for k, why in peer.cancelled(it.request_id).items()}


def _shared(peer, items: list[BlockRequest], parts: list[dict], op: str, verb: str, timeout: float) -> None:
    """The checked requests' rows joined part by part: one NIXL request per part for all of them."""
    members = [Member((verb, it.request_id), it.request_id, sum(int(x.nbytes) for x in p.values()),
                      sum(len(x) for x in p.values())) for it, p in zip(items, parts)]
    peer.agent.submit_many(members, op, join_parts(parts), peer._targets(), timeout,
                           refuse=_refusals(peer, items, op))


def _one_by_one(peer, items: list[BlockRequest], built: Iterable[tuple[dict, dict]], op: str, verb: str,
                timeout: float) -> None:
    """Submit each request on its own (``built``: its parts and staging decision, in order, possibly built
    only when reached); if one cannot be built or started, the ones before it are cancelled (their
    consumers hear ``failed``) and the error is raised."""
    a = peer.agent
    done: list[str] = []
    try:
        for it, (p, staged) in zip(items, built):
            a.submit((verb, it.request_id), it.request_id, op, p, peer._targets(), timeout, staged=staged,
                     refuse=_refusals(peer, [it], op))
            done.append(it.request_id)
    except BaseException as exc:
        for req in done:
            a.cancel_own((verb, req), f"another request of its batch could not start: {exc}")
        raise


def _ask_each(peer, items: list[BlockRequest], timeout: float) -> None:
    """pull_via_push: every request checked here first, then the producer is asked for each."""
    _checks(peer, items)
    for it in items:
        peer.read(it.request_id, it.local_block_ids, it.remote_block_ids, it.num_tokens, timeout, tokens=it.tokens)
