"""What the scheduler-side connector tells the worker-side one each step, and the handshake back.

Plain dataclasses of ints, strings and tuples: they cross vLLM's process boundary
(scheduler in the EngineCore process, workers in their own) by pickling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvlc.engines.vllm.connector.config import Mode
from kvlc.engines.vllm.connector.params import RemotePrefill


@dataclass(frozen=True)
class Load:
    """A decode request whose prompt KV comes from a prefill engine.

    It moves tokens ``[start_token, start_token + num_tokens)``: ``start_token`` tokens were
    a local prefix-cache hit (any offset). ``local_block_ids`` / ``remote_block_ids``: each
    engine's blocks per KV-cache group that the range touches (in token order); ``remote``:
    the producer's params; ``consumer_addresses``: every rank of this engine (a push
    producer writes to all).
    """

    req_id: str
    remote: RemotePrefill
    local_block_ids: tuple[tuple[int, ...], ...]
    remote_block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    mode: Mode
    consumer_addresses: tuple[str, ...]
    start_token: int = 0

    @property
    def tokens(self) -> tuple[int, int]:
        """The token range ``(start, stop)`` this load moves."""
        return self.start_token, self.start_token + self.num_tokens

    @property
    def kvlc_id(self) -> str:
        """The id both agents use on the wire: the producer's request id."""
        return self.remote.remote_request_id


@dataclass(frozen=True)
class Source:
    """A prefill request whose blocks a consumer will take: its block ids and whether its KV is
    complete once this step's forward has run."""

    req_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    complete: bool


@dataclass(frozen=True)
class Hold:
    """A finished prefill request whose blocks stay allocated until its consumer is done or
    ``lease`` seconds pass."""

    req_id: str
    lease: float


@dataclass
class KvlcConnectorMetadata(KVConnectorMetadata):
    """One step's instructions for the workers."""

    loads: list[Load] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # prefill requests no consumer will take


@dataclass
class KvlcHandshake(KVConnectorHandshakeMetadata):
    """A worker rank's addresses, collected by vLLM and given to the scheduler."""

    rank: int
    address: str
    push_address: str
    plan_digest: str
    block_size: int
