"""What ``kv_transfer_params`` carry between a prefill and a decode engine (vLLM's NIXL convention).

The client sends the prefill engine ``{"do_remote_decode": True}``. When the request
finishes, the prefill engine returns a :class:`RemotePrefill` as a plain dict
(``RequestOutput.kv_transfer_params``); the client gives that dict to the decode
engine unchanged. The fields vLLM's NixlConnector uses keep their names and
meaning; ``kvlc_*`` fields are kvlc's own.

>>> p = RemotePrefill(remote_engine_id="e1", remote_request_id="r1", remote_block_ids=((4, 5),),
...     remote_num_tokens=40, remote_host="127.0.0.1", remote_port=7100, tp_size=1,
...     remote_block_size=32, kvlc_addresses=("127.0.0.1:7100",), kvlc_push_addresses=("127.0.0.1:7200",))
>>> d = p.to_params(); d["do_remote_prefill"], d["remote_block_ids"]
(True, [[4, 5]])
>>> RemotePrefill.from_params(d) == p
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvlc.engines.vllm.connector.config import TransferMode
from kvlc.errors import KvlcError

CONNECTOR_TAG = "kvlc"


class RemotePrefill(BaseModel):
    """The producer's answer: where the prompt's KV lies and how to reach it.

    ``remote_block_ids``: the prefill engine's block ids per KV-cache group, in token order.
    ``remote_num_tokens``: tokens whose KV those blocks hold. ``kvlc_addresses``: the kvlc
    side channel of each prefill TP rank (``kvlc_push_addresses``: where a consumer asks
    that rank to push). ``kvlc_cpu_isa``: the producer's CPU attention ISA, so a consumer
    whose ISA orders a block differently refuses with the reason. ``kvlc_produced_at``: when the KV
    was complete, so a consumer never reads a restarted (or woken) producer's renewed memory. ``transfer_mode``: the producer's configured mode (informational;
    the consumer's own ``mode`` decides, unless the params carry ``"mode"``).
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_num_tokens: int = Field(ge=0)
    remote_host: str
    remote_port: int
    tp_size: int = Field(ge=1)
    remote_block_size: int = Field(ge=1)
    kvlc_addresses: tuple[str, ...]
    kvlc_push_addresses: tuple[str, ...]
    kvlc_plan_digest: str = ""
    kvlc_cpu_isa: str = ""  # CPU_ATTN: the producer's attention ISA (its in-block order)
    # when the prefill engine finished the request (its time.time()): a producer rank that restarted or
    # woke from sleep after it holds other bytes there, so a consumer refuses to read them (0: unknown)
    kvlc_produced_at: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    transfer_mode: TransferMode = TransferMode.PULL
    mode: TransferMode | None = None
    connector: str = CONNECTOR_TAG

    def to_params(self) -> dict[str, Any]:
        """The JSON-friendly dict vLLM returns as ``RequestOutput.kv_transfer_params``."""
        d = self.model_dump(mode="json", exclude_none=True)
        return d

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Parse what a client handed the decode engine; :class:`KvlcError` says which field is bad."""
        if params.get("connector", CONNECTOR_TAG) != CONNECTOR_TAG:
            raise KvlcError(
                f"kv_transfer_params come from connector {params.get('connector')!r}, not kvlc; "
                "give the decode engine the dict the kvlc prefill engine returned"
            )
        try:
            p = cls.model_validate(dict(params))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise KvlcError(
                f"kv_transfer_params.{where}: {err['msg']}; pass the prefill engine's "
                "RequestOutput.kv_transfer_params unchanged"
            ) from None
        if len(p.kvlc_addresses) != p.tp_size or len(p.kvlc_push_addresses) != p.tp_size:
            raise KvlcError(
                f"kv_transfer_params: tp_size is {p.tp_size} but {len(p.kvlc_addresses)} kvlc "
                f"address(es) and {len(p.kvlc_push_addresses)} push address(es) are given"
            )
        return p

    def effective_mode(self, default: TransferMode) -> TransferMode:
        """The consumer's mode unless the request overrides it."""
        return self.mode or default


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """A decode-side request whose KV should come from a kvlc prefill engine."""
    return bool(params) and bool(params.get("do_remote_prefill")) and "kvlc_addresses" in params


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill-side request whose KV a decode engine will take."""
    return bool(params) and bool(params.get("do_remote_decode"))
