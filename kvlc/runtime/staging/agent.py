"""Staging inside a :class:`~kvlc.runtime.agent.KvAgent`: its policy, its bounce buffers, its endpoint.

:class:`Stager` is what the agent's pieces ask about staging:

* the connection code (:mod:`kvlc.runtime.peer`, :mod:`kvlc.runtime.server`) asks it for an
  **inbox** when a peer that will WRITE here introduces itself (push: in the reply to the
  producer's hello; pull via push: inside the consumer's hello), and hands it the inbox a
  receiver described (:meth:`Stager.add_peer`), checked before it is used;
* the agent asks once per request which parts to stage (:meth:`Stager.pick`: a WRITE, to a peer
  with an inbox, that the policy picks), and the :class:`~kvlc.runtime.transfer.Executor` sends
  those through the endpoint, one staged send per (request, peer rank);
* the pump hands it every staging notification that verified under a session key.

Only WRITEs are staged: a bounce buffer gathers on the side that holds the source ranges, so
a pull (READ) would need the producer's cooperation, which is what ``mode="pull_via_push"`` is
(the producer WRITEs, staged). A READ the policy would stage stays direct and says so once.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.staging.endpoint import DEFAULT_SLOT_BYTES, BounceBuffer, StageEvent, StagingEndpoint, StagingPolicy
from kvlc.runtime.staging.buffers import DRAM_SLOT_BYTES, StageMode
from kvlc.runtime.staging.copy import Region, Regions, flat_bytes
from kvlc.runtime.staging.wire import ROWS_RESERVE, BounceInfo
from kvlc.runtime.channel.wire import Inbox, Record

log = logging.getLogger("kvlc.runtime.staging.endpoint")


def _placement(policy: StagingPolicy, bindings) -> int | None:
    """The CUDA device bounce buffers live on, or None for DRAM (see :class:`StagingPolicy`)."""
    if policy.bounce == "DRAM":
        return None
    vram = [b.device for b in bindings.values() if b.mem == "VRAM"]
    if vram:
        return vram[0]
    import torch

    if torch.cuda.is_available():
        return torch.cuda.current_device()
    if policy.bounce == "VRAM":
        raise HandshakeError("StagingPolicy(bounce='VRAM') on a machine without a GPU; use 'auto' or 'DRAM'")
    return None


def make_stager(nixl: Any, bindings, policy: StagingPolicy) -> "Stager | None":
    """The agent's :class:`Stager`, or None where its policy can never stage (no buffers registered).

    ``auto`` registers buffers only on a machine with a GPU (a VRAM storage here, or CUDA
    available, so a peer's VRAM can meet this agent's memory), or with ``fragmented_dram``.
    """
    has_vram = any(b.mem == "VRAM" for b in bindings.values())
    if not has_vram and policy.mode is not StageMode.NEVER:
        try:
            import torch

            has_vram = bool(torch.cuda.is_available())
        except ImportError:
            pass
    return Stager(nixl, bindings, policy) if policy.needs_buffers(has_vram) else None


class Stager:
    """One agent's staging (see the module docstring). The caller holds the agent's lock."""

    def __init__(self, nixl: Any, bindings, policy: StagingPolicy):
        self.nixl, self.policy = nixl, policy
        self.device = _placement(policy, bindings)
        regions = Regions([Region(b.addr, b.nbytes, flat_bytes(b.tensor)) for b in bindings.values()])
        self.endpoint = StagingEndpoint(nixl, regions, None, device=self.device,
                                        direct_min_bytes=policy.direct_min_bytes)
        self.said_read = False
        # Every inbox is a share of one buffer registered now, before the agent's NIXL metadata is
        # taken: a peer that loads that metadata can WRITE into any share.
        n = policy.slots * policy.peers
        self.pool = self._buffer(n) if n else None
        self.shares = list(range(policy.peers))       # free shares of the pool
        self.share_of: dict[str, int] = {}             # sending peer → its share

    def _buffer(self, slots: int) -> BounceBuffer:
        size = self.policy.slot_bytes or (DRAM_SLOT_BYTES if self.device is None else DEFAULT_SLOT_BYTES)
        return BounceBuffer(self.nixl, size, slots, self.device)

    # ------------------------------------------------------------------ connections
    def inbox_for(self, peer: str) -> Inbox | None:
        """The inbox ``peer`` (a NIXL agent name) WRITEs into here; None when every share is taken."""
        buf = self.endpoint.inboxes.get(peer)
        if buf is None:
            if not self.shares:
                log.warning("no staging inbox left for '%s' (StagingPolicy.peers=%d): its WRITEs stay direct",
                            peer[:64], self.policy.peers)
                return None
            k = self.share_of[peer] = self.shares.pop(0)
            buf = self.pool.view(k * self.policy.slots, self.policy.slots)
            self.endpoint.accept_from(peer, buf)
        return Inbox(addr=buf.addr, slot_bytes=buf.slot_bytes, stride=buf.stride, slots=buf.slots,
                     mem=buf.mem, device=buf.device)

    def add_peer(self, rec: Record, inbox: Inbox) -> None:
        """Stage to ``rec``'s agent through the inbox it described (its NIXL metadata is loaded).

        The description is checked: room for the ranges in every slot, no overlap with the peer's
        own KV storages (a staged WRITE lands only in the bounce buffer); NIXL refuses any WRITE
        outside what the peer registered."""
        end = inbox.addr + inbox.stride * inbox.slots
        if inbox.stride < inbox.slot_bytes + ROWS_RESERVE or end >= 1 << 63:
            raise HandshakeError(f"agent '{rec.agent}' described an inbox with stride {inbox.stride} for "
                                 f"{inbox.slot_bytes}-byte slots (need slot_bytes + {ROWS_RESERVE}) or "
                                 "past 2^63; not staging to it")
        for s in rec.storages:
            if inbox.addr < s.addr + s.size and s.addr < end:
                raise HandshakeError(f"agent '{rec.agent}' described an inbox overlapping its storage "
                                     f"'{s.name}'; not staging to it")
        if self.endpoint.outbox is None:
            self.endpoint.set_outbox(self._buffer(self.policy.slots))
        if rec.agent in self.endpoint.peers:  # a new session with it: its new inbox replaces the old
            self.endpoint.drop_peer(rec.agent, inbox=False)
        self.endpoint.add_peer(BounceInfo(rec.agent, inbox.addr, inbox.slot_bytes, inbox.stride,
                                          inbox.slots, inbox.mem, inbox.device))

    def drop_peer(self, peer: str) -> None:
        """No live session uses ``peer`` any more: its lists and its inbox here go."""
        if peer in self.endpoint.peers or peer in self.endpoint.inboxes:
            self.endpoint.drop_peer(peer)
        if peer in self.share_of:
            self.shares.append(self.share_of.pop(peer))

    # ------------------------------------------------------------------ requests
    def decide(self, op: str, key, rows: int, nbytes: int, peer: str) -> bool:
        """Whether a part (``key``: its PartKey) goes through bounce buffers."""
        if not self.policy.decide(rows, nbytes, key.local_mem, key.remote_mem):
            return False
        if op == "READ":
            if not self.said_read:
                self.said_read = True
                log.info("a READ (pull) part that the staging policy would stage (%d descriptors, %d bytes, "
                         "%s->%s) stays direct: only WRITEs are staged; connect with mode='pull_via_push' "
                         "to stage pulls (said once)", rows, nbytes, key.remote_mem, key.local_mem)
            return False
        return peer in self.endpoint.peers

    def pick(self, op: str, parts, agents) -> dict[int, list]:
        """Peer rank → the keys in ``parts`` of the parts to stage to it; the rest stay direct. The one
        staging decision of a request (the executor stages what this says).

        ``parts``: key → part of one request (rows, or a prepared part whose ``key`` is its PartKey);
        ``agents``: peer rank → its NIXL agent name."""
        staged: dict[int, list] = {}
        for k, part in parts.items():
            pk = getattr(part, "key", k)  # a prepared part is keyed ("prepped", PartKey)
            if len(part) and self.decide(op, pk, len(part), int(part.nbytes), agents[pk.peer_rank]):
                staged.setdefault(pk.peer_rank, []).append(k)
        return staged

    def send(self, req: str, peer: str, parts: list, key: bytes, timeout: float | None) -> int:
        """Stage the rows of ``parts`` (Part objects of one peer rank) as one staged send."""
        local = np.concatenate([p.local[:, :2] for p in parts])
        remote = np.concatenate([p.remote[:, :2] for p in parts])
        n = self.endpoint.send(req, local, remote, peer, timeout=timeout, key=key)
        self.endpoint.kick()
        return n

    def abort(self, req: str, peer: str, why: str) -> None:
        self.endpoint.abort(req, peer, why)

    def progress(self) -> list[StageEvent]:
        return self.endpoint.progress()

    def close(self) -> None:
        """Release what staging holds, in NIXL's order: WRITEs still in flight, the prepared slot
        lists, then the bounce buffers' registrations; the trace (if any) is written. A handle NIXL
        will not release yet raises :class:`~kvlc.runtime.errors.NixlError` (the agent's close then
        releases it with the rest)."""
        self.endpoint.release_writes()
        for peer in list(self.endpoint.inboxes) + list(self.endpoint.peers):
            self.drop_peer(peer)
        for buf in (self.endpoint.outbox, self.pool):
            if buf is not None:
                buf.release()
        if self.endpoint.trace:
            self.endpoint.trace.dump()
