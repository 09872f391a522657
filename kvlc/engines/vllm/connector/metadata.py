"""What the scheduler-side connector tells the worker-side one each step, and the handshake back.

Plain frozen values of ints, strings and tuples: they cross vLLM's process boundary
(scheduler in the EngineCore process, workers in their own) by pickling. A request's
tokens are one :class:`~kvlc.compiler.request.tokens.TokenRange` and each side's block ids
one :data:`BlockIds` (the plan's group name → ids), from the scheduler to the runtime call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvlc.compiler.frozen import FrozenMap
from kvlc.compiler.request.tokens import TokenRange
from kvlc.engines.vllm.connector.config import TransferMode
from kvlc.engines.vllm.connector.params import RemotePrefill
from kvlc.errors import KvlcError

BlockIds = FrozenMap  # plan group name -> that group's block ids the token range touches, in token order


def plan_block_ids(groups: Sequence[str], per_group: Sequence[Sequence[int]]) -> BlockIds:
    """vLLM's per-group block lists (its KV-cache group order) as :data:`BlockIds` of the plan's groups.

    >>> dict(plan_block_ids(("full",), [[4, 5]]))
    {'full': (4, 5)}
    """
    if len(per_group) > len(groups):
        raise KvlcError(f"{len(per_group)} KV-cache groups of block ids, but the plan has {len(groups)} "
                        f"group(s): {list(groups)}")
    return FrozenMap({groups[i]: tuple(int(b) for b in ids) for i, ids in enumerate(per_group)})


@dataclass(frozen=True)
class Load:
    """A decode request whose prompt KV comes from a prefill engine.

    It moves ``tokens``; tokens before ``tokens.start`` were a local prefix-cache hit (any
    offset). ``local_block_ids`` / ``remote_block_ids``: each engine's blocks that the range
    touches; ``remote``: the producer's params; ``consumer_addresses``: every rank of this
    engine (a push producer writes to all).
    """

    req_id: str
    remote: RemotePrefill
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    tokens: TokenRange
    mode: TransferMode
    consumer_addresses: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        """How many tokens this load moves (a count, never an end index)."""
        return len(self.tokens)

    @property
    def kvlc_id(self) -> str:
        """The id both agents use on the wire: the producer's request id."""
        return self.remote.remote_request_id


@dataclass(frozen=True)
class Source:
    """A prefill request whose blocks a consumer will take: its block ids per vLLM group, how many of
    its tokens have KV after this step, and whether that is all of its prompt."""

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
    """A worker rank's addresses and plan facts, collected by vLLM and given to the scheduler."""

    rank: int
    address: str
    push_address: str
    plan_digest: str
    block_size: int
    groups: tuple[str, ...] = ()  # the plan's group names in vLLM's KV-cache group order
    cpu_isa: str = ""
