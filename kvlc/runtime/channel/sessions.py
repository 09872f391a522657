"""Engine sessions: every piece of remote state is keyed by an authenticated session.

A :class:`Session` is one remote rank of one remote engine (engine id, rank, epoch, NIXL agent
name, handshake record) as introduced on one authenticated side-channel connection (whose id
and notification key it keeps). A remote engine's ranks form a :class:`RemoteEngine`
(engine id + plan + this side's direction), which holds the pairing program and binds it to the
current sessions' bases. Rules (:meth:`SessionTable.admit`):

* an agent name belongs to one (engine id, rank, epoch): another engine or rank claiming it is
  refused (identity hijack), as is another record for the same epoch (record replacement);
* a new epoch of the same (engine id, rank) is a restart: it replaces that rank's sessions of
  older epochs (their requests fail, their NIXL agent is removed), and nothing else;
* engines with the same plan, or the same rank numbers, never share state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from kvlc.compiler.pairing.pair import pair
from kvlc.compiler.pairing.program import TransferProgram
from kvlc.compiler.request.bind import bind
from kvlc.compiler.request.instantiate import prepare_bound
from kvlc.compiler.request.rules import prepare
from kvlc.compiler.plan.model import Plan
from kvlc.runtime.errors import HandshakeError
from kvlc.runtime.kinds import Direction, ConnectionMode
from kvlc.runtime.channel.wire import Record


@dataclass(eq=False)
class Session:
    """One remote rank, introduced on one authenticated connection (see the module docstring)."""

    record: Record
    conn_id: str
    notif_key: bytes
    direction: Direction   # this side's direction towards the remote
    mode: ConnectionMode             # the wire mode the connection was made with
    engine: RemoteEngine
    address: str = ""      # where the remote serves (push consumers cancel there)
    server_side: bool = False  # introduced to our server (else: we connected to it)
    live: bool = True

    @property
    def agent(self) -> str:
        return self.record.agent

    @property
    def rank(self) -> int:
        return self.record.rank

    @property
    def epoch(self) -> str:
        return self.record.epoch

    @property
    def engine_id(self) -> str:
        return self.record.engine_id

    def __repr__(self) -> str:
        return f"<Session {self.engine_id} rank {self.rank} epoch {self.epoch[:8]} agent {self.agent}>"


@dataclass(eq=False)
class RemoteEngine:
    """The ranks of one remote engine that this side pairs with in one direction."""

    engine_id: str
    plan: Plan
    program: TransferProgram
    direction: Direction
    current: dict[int, Record] = field(default_factory=dict)  # rank → record of its current epoch
    _bound: object = None

    @cached_property
    def key(self) -> tuple[str, str, str]:
        """(engine id, plan digest, direction): fixed for this object (asked on every request)."""
        return (self.engine_id, self.plan.digest, self.direction.value)

    @property
    def expected(self) -> frozenset[int]:
        return frozenset(self.program.peer_ranks)

    def bound(self, local_bases: Mapping[str, tuple[int, int]]):
        """The program with every storage base fixed from the current records (placeholders for ranks
        not introduced yet: the caller only keeps the parts of ranks it knows)."""
        if self._bound is None:
            placeholder = {s.name: (0, s.device) for s in self.plan.storages}
            remote = {r: (self.current[r].bases() if r in self.current else placeholder) for r in self.expected}
            self._bound = prepare_bound(bind(self.program, local_bases, remote))  # (not in the first request)
        return self._bound


class SessionTable:
    """Sessions and remote engines of one agent (the caller holds the agent's lock)."""

    def __init__(self, plan: Plan, rank: int, own_agent: str):
        self.plan, self.rank, self.own_agent = plan, rank, own_agent
        self.engines: dict[tuple[str, str, str], RemoteEngine] = {}
        self.by_conn: dict[str, Session] = {}
        self.by_agent: dict[str, list[Session]] = {}

    IDLE_ENGINES = 64  # remote engines kept with no session (a restart finds its pairing again)

    def engine(self, rec: Record, direction: Direction) -> RemoteEngine:
        """The remote engine of ``rec`` (created on first sight; CompatError here). Pairings are
        shared by engines of one plan; engines with no session beyond :attr:`IDLE_ENGINES` are
        forgotten, oldest first, so engines that come and go under new ids leave nothing behind."""
        key = (rec.engine_id, rec.plan_digest, direction.value)
        eng = self.engines.pop(key, None)
        if eng is None:
            same_plan = next((e for (_, d, dr), e in self.engines.items() if (d, dr) == key[1:]), None)
            program = same_plan.program if same_plan is not None else prepare(
                pair(self.plan, rec.plan, local_rank=self.rank, direction=direction.value))
            eng = RemoteEngine(rec.engine_id, rec.plan, program, direction)
        self.engines[key] = eng  # most recently used last
        self._forget_idle()
        return eng

    def _forget_idle(self) -> None:
        busy = {id(s.engine) for s in self.by_conn.values()}
        idle = [k for k, e in self.engines.items() if id(e) not in busy and not e.current]
        for key in idle[:max(0, len(idle) - self.IDLE_ENGINES)]:
            del self.engines[key]

    def check(self, rec: Record, eng: RemoteEngine) -> list[Session]:
        """Refuse a record that would hijack a name or replace a live record; return what it replaces."""
        if rec.agent == self.own_agent:
            raise HandshakeError(f"agent name '{rec.agent}' is this agent's own name")
        if rec.rank not in eng.expected:
            raise HandshakeError(
                f"rank {rec.rank} of '{rec.plan.name}' does not exchange bytes with rank {self.rank} of "
                f"'{self.plan.name}' (peers of this rank: {sorted(eng.expected)})"
            )
        for s in self.by_agent.get(rec.agent, ()):
            if s.live and (s.engine_id, s.rank) != (rec.engine_id, rec.rank):  # (a new epoch is a restart)
                raise HandshakeError(
                    f"agent name '{rec.agent}' already belongs to rank {s.rank} of engine '{s.engine_id}' "
                    f"(epoch {s.epoch[:8]}); refusing a second claim to it"
                )
        replaced = []
        for s in self.by_conn.values():
            if not s.live or (s.engine_id, s.rank) != (rec.engine_id, rec.rank):
                continue
            if s.epoch == rec.epoch and s.record != rec:
                raise HandshakeError(
                    f"rank {rec.rank} of engine '{rec.engine_id}' already introduced another record in "
                    f"epoch {rec.epoch[:8]} (agent '{s.agent}'); a rank's record cannot change within an epoch"
                )
            if s.epoch != rec.epoch:
                replaced.append(s)
        return replaced

    def add(self, session: Session) -> None:
        old = self.by_conn.get(session.conn_id)
        if old is not None and old is not session:
            raise HandshakeError("this connection already introduced a session; open another connection")
        self.by_conn[session.conn_id] = session
        self.by_agent.setdefault(session.agent, []).append(session)
        eng = session.engine
        if eng.current.get(session.rank) != session.record:
            eng.current[session.rank] = session.record
            eng._bound = None

    def drop(self, session: Session) -> bool:
        """Mark a session dead and forget it; True when no live session uses its NIXL agent any more."""
        session.live = False
        self.by_conn.pop(session.conn_id, None)
        rest = [s for s in self.by_agent.get(session.agent, ()) if s is not session and s.live]
        if rest:
            self.by_agent[session.agent] = rest
        else:
            self.by_agent.pop(session.agent, None)
        eng = session.engine
        if eng.current.get(session.rank) is session.record and not any(
            s.engine is eng and s.rank == session.rank for s in self.by_conn.values()
        ):
            del eng.current[session.rank]
            eng._bound = None
        return not rest

    def live(self, agent: str) -> list[Session]:
        return [s for s in self.by_agent.get(agent, ()) if s.live]

    def all(self) -> list[Session]:
        return list(self.by_conn.values())
