"""The connector's one door to the kvlc runtime: an agent per worker rank, its peers, pushes.

Everything the vLLM connector does with :mod:`kvlc.runtime` happens here, so a
runtime change is adapted in one place. A :class:`Transport` owns:

* the rank's :class:`~kvlc.runtime.KvAgent` (the engine's KV tensors, bound through its
  plan, served on the rank's side channel);
* one :class:`~kvlc.runtime.Peer` per remote engine and direction, made on first use
  (pairing, and so any incompatibility, surfaces there);
* for ``push``: a small listener where a consumer names the blocks it wants written. A
  push is accepted only for a request this rank holds, whose KV is complete, and whose
  named source blocks are that request's own.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError

from kvlc.engines.vllm.connector.config import ConnectorSettings, Mode
from kvlc.engines.vllm.connector.layout import EnginePlan
from kvlc.errors import KvlcError
from kvlc.runtime import Completions, KvAgent, Peer
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.channel.auth import resolve_secret
from kvlc.runtime.channel.tcp import ChannelClient, ChannelServer

log = logging.getLogger("vllm.kvlc")  # under vLLM's logger: its handlers and levels apply


class PushAsk(BaseModel):
    """A consumer asks a producer rank to WRITE request ``req``'s blocks into its own."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    req: str
    consumer_addresses: tuple[str, ...]
    producer_blocks: dict[str, tuple[int, ...]]
    consumer_blocks: dict[str, tuple[int, ...]]
    num_tokens: int
    start_token: int = 0      # the push moves tokens [start_token, num_tokens)

    @property
    def span(self) -> dict:
        """The request's tokens as keywords for ``Peer.write``."""
        return {"tokens": (self.start_token, self.num_tokens)} if self.start_token else {"num_tokens": self.num_tokens}


@dataclass
class _Source:
    blocks: dict[str, tuple[int, ...]]
    ready: bool = False


def _reply(ok: bool, error: str = "") -> bytes:
    return json.dumps({"ok": ok, "error": error[:2000]}).encode()


class Transport:
    """One worker rank's kvlc agent and its connections (see the module docstring)."""

    def __init__(self, ep: EnginePlan, settings: ConnectorSettings, engine_id: str):
        self.ep = ep
        self.settings = settings
        self._key = resolve_secret(None)  # $KVLC_SECRET (or $KVLC_SECRET_FILE); refuses to run without
        self.agent = KvAgent(ep.plan, ep.rank, ep.tensors, AgentSettings(
            engine_id=engine_id, lease=settings.lease, timeout=settings.timeout, progress="thread"))
        self.address = self.agent.serve(settings.host, settings.port_for(ep.rank))
        self._lock = threading.RLock()
        self._peers: dict[tuple, Peer] = {}
        self._sources: dict[str, _Source] = {}
        self._asks: dict[str, PushAsk] = {}  # pushes asked for before the source was ready
        self._push_failed: dict[str, str] = {}
        self._server = ChannelServer(self._on_push, lambda text: _reply(False, text), self._key,
                                     settings.host, 0)
        host, port = self._server.address
        self.push_address = f"{host}:{port}"

    # ------------------------------------------------------------------ consumer side
    def groups(self, per_group: Sequence[Sequence[int]]) -> dict[str, tuple[int, ...]]:
        """vLLM's per-group block lists → the plan's ``{group name: ids}``."""
        if len(per_group) > len(self.ep.groups):
            raise KvlcError(
                f"{len(per_group)} KV-cache groups of block ids, but plan '{self.ep.plan.name}' "
                f"has {len(self.ep.groups)} group(s): {list(self.ep.groups)}"
            )
        return {self.ep.groups[i]: tuple(int(b) for b in ids) for i, ids in enumerate(per_group)}

    def peer(self, addresses: Sequence[str], direction: str, mode: str = "direct") -> Peer:
        """The connection to the engine at ``addresses`` (made, and paired, on first use)."""
        key = (tuple(addresses), direction, mode)
        with self._lock:
            p = self._peers.get(key)
            if p is None:
                p = self.agent.connect(*addresses, direction=direction, mode=mode)
                self._peers[key] = p
            return p

    def forget_peer(self, addresses: Sequence[str]) -> None:
        """Drop cached connections to an engine that failed (it may have restarted)."""
        with self._lock:
            for key in [k for k in self._peers if k[0] == tuple(addresses)]:
                p = self._peers.pop(key)
                try:
                    p.close()
                except KvlcError:
                    pass

    def load(self, req: str, mode: Mode, producer: Sequence[str], producer_push: Sequence[str],
             consumers: Sequence[str], local: Mapping[str, Sequence[int]],
             remote: Mapping[str, Sequence[int]], tokens: tuple[int, int], ask: bool) -> None:
        """Start moving tokens ``[start, stop)`` of request ``req`` into this rank's ``local`` blocks
        (ids: each side's blocks the range touches). Non-blocking; raises :class:`KvlcError` when
        the producer cannot be reached or refuses (pairing)."""
        start, stop = int(tokens[0]), int(tokens[1])
        span = {"tokens": (start, stop)} if start else {"num_tokens": stop}
        if mode is Mode.PULL:
            self.peer(producer, "READ").read(req, local, remote, **span)
        elif mode is Mode.PULL_VIA_PUSH:
            self.peer(producer, "READ", "pull_via_push").read(req, local, remote, **span)
        else:
            self.agent.expect(req, self.settings.timeout)
            if ask:
                msg = PushAsk(req=req, consumer_addresses=tuple(consumers),
                              producer_blocks={g: tuple(v) for g, v in remote.items()},
                              consumer_blocks={g: tuple(v) for g, v in local.items()},
                              num_tokens=stop, start_token=start)
                for addr in producer_push:
                    self._ask(addr, msg)

    def _ask(self, address: str, msg: PushAsk) -> None:
        client = ChannelClient(address, self._key, timeout=self.settings.timeout)
        try:
            reply = json.loads(client.request(msg.model_dump_json().encode()))
        finally:
            client.close()
        if not reply.get("ok"):
            raise KvlcError(f"producer rank at {address} refused to push '{msg.req}': {reply.get('error')}")

    # ------------------------------------------------------------------ producer side
    def offer(self, req: str, lease: float) -> None:
        """A finished request's blocks wait for their consumer; freeable after ``lease`` at the latest."""
        self.agent.offer(req, lease)

    def add_source(self, req: str, blocks: Mapping[str, Sequence[int]]) -> None:
        with self._lock:
            src = self._sources.setdefault(req, _Source({}))
            src.blocks = {g: tuple(v) for g, v in blocks.items()}

    def source_ready(self, req: str) -> None:
        """Request ``req``'s KV is complete on this rank: serve a push asked for earlier."""
        with self._lock:
            src = self._sources.get(req)
            if src is None:
                return
            src.ready = True
            ask = self._asks.pop(req, None)
        if ask is not None:
            self._push(ask)

    def drop_source(self, req: str) -> None:
        with self._lock:
            self._sources.pop(req, None)
            self._asks.pop(req, None)

    def _on_push(self, conn, frame: bytes) -> bytes:
        try:
            ask = PushAsk.model_validate_json(frame)
        except ValidationError as exc:
            return _reply(False, f"not a push request: {exc.errors()[0]['msg']}")
        with self._lock:
            src = self._sources.get(ask.req)
            if src is None:
                return _reply(False, f"request '{ask.req}' is not held by this engine (finished or unknown)")
            for g, ids in ask.producer_blocks.items():
                first = ask.start_token // self.ep.plan.group(g).block_size if g in self.ep.groups else 0
                mine = src.blocks.get(g, ())[first:]   # the request's own blocks from the range's first
                if tuple(mine[: len(ids)]) != tuple(ids):
                    return _reply(False, f"request '{ask.req}' group '{g}': blocks {list(ids)[:8]} are "
                                         f"not the request's own {list(mine)[:8]}")
            if not src.ready:
                self._asks[ask.req] = ask
                return _reply(True)
        return self._push(ask)

    def _push(self, ask: PushAsk) -> bytes:
        try:
            self.peer(ask.consumer_addresses, "WRITE").write(
                ask.req, ask.producer_blocks, ask.consumer_blocks, **ask.span)
        except KvlcError as exc:
            log.error("kvlc: push of '%s' refused: %s", ask.req, exc)
            with self._lock:
                self._push_failed[ask.req] = str(exc)
            return _reply(False, str(exc))
        return _reply(True)

    # ------------------------------------------------------------------ both
    def poll(self) -> Completions:
        c = self.agent.poll()
        with self._lock:
            failed, self._push_failed = self._push_failed, {}
        if failed:
            merged = dict(c.failed)
            merged.update(failed)
            c = Completions(c.finished, merged, c.held, tuple(c.freeable) + tuple(failed))
        return c

    @property
    def stats(self) -> dict:
        return dict(self.agent.stats)

    def close(self) -> None:
        self._server.close()
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for p in peers:
            try:
                p.close()
            except KvlcError:
                pass
        self.agent.close()
