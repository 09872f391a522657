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

from kvlc.compiler.request.tokens import TokenRange
from kvlc.engines.vllm.connector.config import ConnectorSettings, TransferMode
from kvlc.engines.vllm.connector.layout import EnginePlan
from kvlc.engines.vllm.connector.metadata import Load
from kvlc.errors import KvlcError
from kvlc.runtime import Completions, KvAgent, Peer
from kvlc.runtime.transfer import Outgoing
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.channel.auth import resolve_secret
from kvlc.runtime.channel.client import ChannelClient
from kvlc.runtime.channel.tcp import ChannelServer

log = logging.getLogger("vllm.kvlc")  # under vLLM's logger: its handlers and levels apply


class PushAsk(BaseModel):
    """A consumer asks a producer rank to WRITE request ``req``'s blocks into its own."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    req: str
    consumer_addresses: tuple[str, ...]
    producer_blocks: dict[str, tuple[int, ...]]
    consumer_blocks: dict[str, tuple[int, ...]]
    start: int               # the push moves tokens [start, stop)
    stop: int

    @property
    def tokens(self) -> TokenRange:
        return TokenRange(self.start, self.stop)


@dataclass
class _Source:
    blocks: dict[str, tuple[int, ...]]
    ready: bool = False


def _reply(ok: bool, error: str = "") -> bytes:
    return json.dumps({"ok": ok, "error": error[:2000]}).encode()


class Transport:
    """One worker rank's kvlc agent and its connections (see the module docstring)."""

    def __init__(self, ep: EnginePlan, settings: ConnectorSettings, engine_id: str,
                 ports: tuple[int, int] | None = None):
        """``ports``: the side channel's and the push listener's ports to serve on (a rank woken from
        sleep keeps the addresses its peers know); default: the settings' port and a free one."""
        self.ep = ep
        self.settings = settings
        self._key = resolve_secret(None)  # $KVLC_SECRET (or $KVLC_SECRET_FILE); refuses to run without
        self.agent = KvAgent(ep.plan, ep.rank, ep.tensors, AgentSettings(
            engine_id=engine_id, lease=settings.lease, timeout=settings.timeout, progress="thread"))
        self._lock = threading.RLock()
        self._peers: dict[tuple, Peer] = {}
        self._sources: dict[str, _Source] = {}
        self._asks: dict[str, PushAsk] = {}  # pushes asked for before the source was ready
        self._push_failed: dict[str, str] = {}
        channel, push = ports if ports is not None else (settings.port_for(ep.rank), 0)
        try:
            self.address = self.agent.serve(settings.host, channel)
            self._server = ChannelServer(self._on_push, lambda text: _reply(False, text), self._key,
                                         settings.host, push)
        except KvlcError:
            self.agent.close()
            raise
        host, port = self._server.address
        self.push_address = f"{host}:{port}"

    # ------------------------------------------------------------------ consumer side
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

    def load(self, load: Load, ask: bool) -> Outgoing | None:
        """Start moving ``load.tokens`` of the request into this rank's blocks (``load``'s block ids:
        each side's blocks the range touches). Non-blocking; raises :class:`KvlcError` when the
        producer cannot be reached or refuses (pairing). ``ask``: this rank asks a push producer.
        Returns the READ this rank posted (pull), None where the producer moves the bytes."""
        req, producer, tokens = load.kvlc_id, load.remote.kvlc_addresses, load.tokens
        if load.mode is TransferMode.PUSH:
            self.agent.expect(req, self.settings.timeout, producer=load.remote.remote_engine_id)
            if ask:
                msg = PushAsk(req=req, consumer_addresses=tuple(load.consumer_addresses),
                              producer_blocks=dict(load.remote_block_ids), consumer_blocks=dict(load.local_block_ids),
                              start=tokens.start, stop=tokens.stop)
                for addr in load.remote.kvlc_push_addresses:
                    self._ask(addr, msg)
            return None
        mode = "pull_via_push" if load.mode is TransferMode.PULL_VIA_PUSH else "direct"
        return self.peer(producer, "READ", mode).read(req, load.local_block_ids, load.remote_block_ids,
                                                      tokens=tokens, produced_at=load.remote.kvlc_produced_at or None)

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
                first = ask.start // self.ep.plan.group(g).block_size if g in self.ep.groups else 0
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
                ask.req, ask.producer_blocks, ask.consumer_blocks, tokens=TokenRange(ask.start, ask.stop))
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
