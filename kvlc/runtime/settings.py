"""An agent's options as one settings object: explicit values beat ``KVLC_*`` variables beat defaults.

>>> AgentSettings(timeout=5, progress="manual").timeout
5.0

Every plain field reads ``KVLC_<FIELD>`` (``KVLC_TIMEOUT``, ``KVLC_LEASE``, ``KVLC_PROGRESS``,
``KVLC_ENGINE_ID``, ``KVLC_SECRET``, ``KVLC_SECRET_FILE``, ``KVLC_INSECURE``, ``KVLC_HOST``, ``KVLC_PORT``,
``KVLC_ADVERTISE`` …) where it is not given. ``host``/``port`` are where the side channel binds,
``advertise`` the host peers are told (by default the bound host; never a wildcard address).
The objects (``limits``, ``ucx``, ``staging``, ``agent_factory``) are given explicitly or left
``None``: then ``ucx`` comes from ``KVLC_UCX_*`` (:meth:`UcxOptions.for_agent`) and ``staging`` from
``KVLC_STAGING*`` (:meth:`StagingPolicy.from_env`), read when the agent is made.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from kvlc.errors import KvlcError
from kvlc.runtime.channel.auth import read_secret_file, resolve_secret
from kvlc.runtime.channel.tcp import Limits
from kvlc.runtime.ipc.driver import DEFAULT_GPU_CALLS, GpuCalls
from kvlc.runtime.nixl.ucx import UcxOptions
from kvlc.runtime.staging.buffers import StagingPolicy

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_LEASE_S = 30.0
_OBJECTS = frozenset({"limits", "ucx", "staging", "agent_factory"})  # given explicitly, never parsed from text


def check_advertised(host: str) -> str:
    """``host`` where peers can reach it: not empty and not a wildcard (0.0.0.0, ::), which means "every
    interface" when binding but nothing a peer can connect to."""
    bare = host.strip().strip("[]")
    try:
        wildcard = not bare or ipaddress.ip_address(bare).is_unspecified
    except ValueError:  # a host name: resolved by the peer
        wildcard = False
    if wildcard:
        raise KvlcError(
            f"advertised side-channel address {host!r} is a wildcard: peers cannot connect to it. Bind with "
            "host='0.0.0.0' if you like, but set advertise= (or $KVLC_ADVERTISE) to this host's address on "
            "the network the peers use, e.g. AgentSettings(host='0.0.0.0', advertise='10.0.0.7')")
    return host


class _PlainEnv(EnvSettingsSource):
    """``KVLC_<FIELD>`` for the plain fields only (``KVLC_STAGING`` belongs to :class:`StagingPolicy`)."""

    def get_field_value(self, field, field_name: str):
        if field_name in _OBJECTS:
            return None, field_name, False
        return super().get_field_value(field, field_name)


class AgentSettings(BaseSettings):
    """How a :class:`~kvlc.runtime.agent.KvAgent` runs (see the module docstring for the sources).

    ``engine_id`` names the engine (every rank of it passes the same; default: a fresh id per
    agent). ``timeout``: default seconds per request. ``lease``: seconds after which a producer
    reports a request's source blocks freeable when no consumer finished with them. ``progress``:
    ``"thread"`` (a kvlc thread advances transfers every ``progress_interval`` s), ``"nixl"``
    (NIXL's own progress thread) or ``"manual"`` (only ``poll()`` advances anything). ``secret``
    (else ``secret_file``) keys the side channel; ``insecure=True`` runs without one.
    ``ipc``: ``"auto"`` copies to and from a peer on the same host through its mapped memory
    (CUDA IPC for VRAM, shared files for DRAM; :mod:`kvlc.runtime.ipc`) where both sides can,
    NIXL for everything else; ``"off"`` (``KVLC_IPC=off``): NIXL only. ``ipc_min_rows``: a part
    between two GPUs' memories (VRAM on both sides) with fewer rows goes through NIXL even so: UCX
    moves a few large rows on the copy engines as fast as the copy kernel, without the kernel's start
    (measured on an H100 and an H200: contiguous handovers and bulk pushes of 32 rows per part were
    faster through NIXL; scattered blocks, thousands of rows, through the kernel); 0 copies every part.
    ``ipc_gpu_calls``: how a same-host copy on a GPU orders and launches its kernel: ``"driver"`` (the default:
    the CUDA driver's calls with the GIL kept, :mod:`kvlc.runtime.ipc.driver`; warm-up checks them by content and
    falls back to torch's) or ``"torch"`` (``KVLC_IPC_GPU_CALLS=torch``: torch's events and Triton's launcher, each
    call letting the GIL go: beside an engine's busy Python thread a copy's start then took 34 ms, against 73 µs
    with the driver's; benchmarks/README.md, run 38).
    ``ipc_copy_engine``: on a GPU, a part with host memory on one side (this side's pinned DRAM, the peer's
    VRAM) whose rows average 256 KiB or more goes on the GPU's copy engines through kvlc's own driver calls (a
    ``cuMemcpyAsync`` per row, the GIL kept, checked by content at warm-up) instead of the copy kernel, whose
    loads across PCIe fall short of the pinned copy; ``KVLC_IPC_COPY_ENGINE=false``: the kernel.
    ``notes_agent``: a second NIXL agent carries this agent's ``done`` notifications to peers that have one too
    (:mod:`kvlc.runtime.nixl.notes`), so that a WRITE's flush never waits for the peer to take the ``done`` sent
    before it; ``KVLC_NOTES_AGENT=false``: none (``done`` goes through the agent that moved the bytes).
    ``agent_factory`` (tests only) builds the NIXL agent wrapper from a name.
    """

    model_config = SettingsConfigDict(env_prefix="KVLC_", env_ignore_empty=True, frozen=True, extra="forbid",
                                      arbitrary_types_allowed=True)

    engine_id: str | None = None
    name: str | None = None
    host: str = "127.0.0.1"       # where serve() binds the side channel (0.0.0.0 / :: for every interface)
    port: int = Field(0, ge=0, lt=1 << 16)  # 0: any free port
    advertise: str | None = None  # the host peers are told to reach (default: host, never a wildcard)
    secret: SecretStr | None = None
    secret_file: Path | None = None
    insecure: bool = False
    timeout: float = DEFAULT_TIMEOUT_S
    lease: float = DEFAULT_LEASE_S
    progress: Literal["thread", "nixl", "manual"] | str = "thread"  # checked by the agent, with the fix named
    progress_interval: float = Field(0.001, gt=0)
    backends: tuple[str, ...] = ("UCX",)
    telemetry: bool = False
    ipc: Literal["auto", "off"] = "auto"  # same-host peers: copy through their mapped memory (kvlc.runtime.ipc)
    ipc_min_rows: int = Field(64, ge=0)  # VRAM-to-VRAM parts of fewer rows go through NIXL (see above)
    ipc_gpu_calls: GpuCalls = DEFAULT_GPU_CALLS  # a GPU copy's ordering and launch calls (see above)
    ipc_copy_engine: bool = True  # long rows with host memory on one side on a GPU's copy engines (see above)
    notes_agent: bool = True  # `done` through a NIXL agent of its own (see above)
    limits: Limits = Field(default_factory=Limits)
    ucx: UcxOptions | None = None
    staging: StagingPolicy | None = None
    agent_factory: Callable[[str], Any] | None = None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings: PydanticBaseSettingsSource,
                                   env_settings, dotenv_settings, file_secret_settings):
        return init_settings, _PlainEnv(settings_cls)

    def channel_key(self) -> bytes:
        """The side channel's key: ``secret``, else ``secret_file``'s content (AuthError where neither is
        set and ``insecure`` is false, or the secret is too short)."""
        if self.secret is not None:
            return resolve_secret(self.secret.get_secret_value())
        if self.secret_file is not None:
            return resolve_secret(read_secret_file(self.secret_file))
        return resolve_secret(None, self.insecure)

    def advertised_host(self, bound: str | None = None) -> str:
        """The host peers are given to reach the side channel bound at ``bound`` (default :attr:`host`):
        :attr:`advertise`, else the bound host; KvlcError where that is a wildcard address.

        >>> AgentSettings(host="0.0.0.0", advertise="10.0.0.7").advertised_host()
        '10.0.0.7'
        """
        return check_advertised(self.advertise or (self.host if bound is None else bound))

    def ucx_options(self, vram: bool) -> UcxOptions:
        return self.ucx if self.ucx is not None else UcxOptions.for_agent(vram)

    def staging_policy(self) -> StagingPolicy:
        return self.staging if self.staging is not None else StagingPolicy.from_env()
