"""The connector's settings: ``kv_connector_extra_config`` parsed into one frozen model.

>>> c = ConnectorSettings.from_extra({"host": "127.0.0.1", "port": 7100, "mode": "pull"})
>>> c.mode, c.port_for(1)
(<TransferMode.PULL: 'pull'>, 7101)
>>> ConnectorSettings.from_extra({"mode": "pul"})
Traceback (most recent call last):
...
kvlc.errors.KvlcError: kv_connector_extra_config.mode: 'pul' is not a transfer mode; did you mean 'pull'?
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from kvlc.errors import KvlcError, did_you_mean

SECRET_ENV = "KVLC_SECRET"


class TransferMode(str, enum.Enum):
    """How a request's KV moves from the prefill engine to the decode engine."""

    PULL = "pull"  # the decode worker READs from the prefill engine's agent
    PUSH = "push"  # the decode worker names its blocks; the prefill engine's worker WRITEs them
    PULL_VIA_PUSH = "pull_via_push"  # the decode worker sends ids; the prefill agent WRITEs on its own


class Role(str, enum.Enum):
    """vLLM's ``kv_role`` values."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"


class ConnectorSettings(BaseModel):
    """What ``kv_connector_extra_config`` may hold (unknown keys are refused).

    ``host``/``port``: where rank r of this engine serves its kvlc side channel (``port + r``;
    ``port: 0`` picks free ports, advertised to peers through ``kv_transfer_params``).
    ``mode``: how this engine, as a consumer, loads KV (a request's ``kv_transfer_params``
    may override it with ``"mode"``). ``spec``: a kvlc spec file checked against the live
    tensors instead of deriving one. ``lease``: seconds a producer holds a finished
    request's blocks for its consumer. ``timeout``: seconds a transfer may take.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = 0
    mode: TransferMode = TransferMode.PULL
    spec: str | None = None
    lease: float = 30.0
    timeout: float = 30.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse ``kv_connector_extra_config``; a :class:`KvlcError` names the key on bad input."""
        data = dict(extra or {})
        cls._check_keys(data)
        try:
            settings = cls(**data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise KvlcError(
                f"kv_connector_extra_config.{where}: {err['msg']} (found {err.get('input')!r})"
            ) from None
        settings._check_ranges()
        return settings

    @classmethod
    def _check_keys(cls, data: dict) -> None:
        """Refuse an unknown mode or key, with the nearest known one."""
        mode = data.get("mode")
        if mode is not None and mode not in {m.value for m in TransferMode}:
            raise KvlcError(
                f"kv_connector_extra_config.mode: {mode!r} is not a transfer mode; "
                f"{did_you_mean(str(mode), [m.value for m in TransferMode])}"
            )
        unknown = [k for k in data if k not in cls.model_fields]
        if unknown:
            raise KvlcError(
                f"kv_connector_extra_config: unknown key {unknown[0]!r}; "
                f"{did_you_mean(unknown[0], cls.model_fields)}"
            )

    def _check_ranges(self) -> None:
        if not 0 <= self.port < 65536:
            raise KvlcError(f"kv_connector_extra_config.port: expected 0..65535, found {self.port}")
        if self.lease <= 0 or self.timeout <= 0:
            raise KvlcError("kv_connector_extra_config: lease and timeout must be positive seconds")

    def port_for(self, rank: int) -> int:
        """The side-channel port of TP rank ``rank`` (0: any free port)."""
        return self.port + rank if self.port else 0


def secret() -> str | None:
    """The shared secret from ``KVLC_SECRET`` (None when unset)."""
    return os.environ.get(SECRET_ENV) or None
