"""UCX backend settings: typed backend parameters and the one environment default the runtime sets.

:class:`UcxOptions` is what :class:`~kvlc.runtime.nixl.core.Agent` passes to NIXL's
``create_backend("UCX", ...)``. :meth:`UcxOptions.for_agent` picks the defaults: UCX's thread
pool (``num_threads`` :data:`GPU_THREADS`, ``split_batch_size`` 4) for an agent that holds VRAM,
none for a DRAM-only one. Measured on an H200 (two processes, one GPU, cuda_ipc, 2026-12-01,
benchmarks/README.md "UCX's thread pool, measured by rounds"): kvlc's push of 256 MiB requests
(32 descriptors) ran at 619-972 GB/s in steady rounds with the pool and 389-628 without (32 in
flight), 498-753 and 395-611 at 4 in flight, pull 569-994 and 472-674; the pool's first round
was 2-4x slower, which the connect-time warm-up (:mod:`kvlc.runtime.nixl.warmup`) takes away.
(Earlier runs had measured the pool slower: they timed two rounds, the first of them cold.)
DRAM-only agents were not measured with it and keep NIXL's default. Explicit
``UcxOptions(...)``, or ``KVLC_UCX_NUM_THREADS`` (``0``: no pool) / ``KVLC_UCX_SPLIT_BATCH_SIZE`` /
``KVLC_UCX_NUM_WORKERS`` in the environment (:meth:`UcxOptions.from_env`), override it.

Environment: UCX turns cuda_ipc reads (``get_zcopy``) off when NVML reports no
NVLink, which makes READ (pull) fall back to emulation over TCP (0.5 GB/s against
~1,200 with it on, two processes on one H200). :func:`apply_env` sets
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` when the user has not set it, at agent creation
(UCX reads its environment when NIXL creates the backend, never at import), and
logs that it did. To keep UCX's own choice, set the variable yourself (``=n`` or
``=try``) or pass ``UcxOptions(cuda_ipc_get_zcopy=False)``.

>>> opts = UcxOptions(num_threads=4, split_batch_size=8)
>>> opts.backend_params()
{'num_threads': '4', 'split_batch_size': '8', 'num_workers': '1'}
>>> UcxOptions().backend_params()
{'num_workers': '1'}
>>> UcxOptions.from_env({"KVLC_UCX_NUM_THREADS": "4"}).backend_params()
{'num_threads': '4', 'split_batch_size': '4', 'num_workers': '1'}
>>> UcxOptions.for_agent(vram=True, environ={}).backend_params()
{'num_threads': '4', 'split_batch_size': '4', 'num_workers': '1'}
>>> UcxOptions.for_agent(vram=True, environ={"KVLC_UCX_NUM_THREADS": "0"}).backend_params()
{'num_workers': '1'}
>>> UcxOptions.for_agent(vram=False, environ={}).backend_params()
{'num_workers': '1'}
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvlc.errors import KvlcError, did_you_mean

log = logging.getLogger("kvlc.runtime.nixl.ucx")

GET_ZCOPY_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
DEFAULT_SPLIT_BATCH = 4  # with a thread pool and no split size given
GPU_THREADS = 4  # UCX pool threads of an agent that holds VRAM, unless told otherwise (module doc)
ENV_FIELDS = {"KVLC_UCX_NUM_THREADS": "num_threads", "KVLC_UCX_SPLIT_BATCH_SIZE": "split_batch_size",
              "KVLC_UCX_NUM_WORKERS": "num_workers"}
_set_by_kvlc: set[str] = set()  # variables this module set (not the user's), so later agents see them as ours


class ErrorHandling(str, enum.Enum):
    """UCX endpoint error handling (NIXL's ``ucx_error_handling_mode``)."""

    PEER = "peer"
    NONE = "none"


class UcxOptionError(KvlcError):
    """A UCX backend option has a bad value."""


def _count(name: str, value: int | None, low: int, high: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UcxOptionError(
            f"UcxOptions.{name}: expected an integer in {low}..{high} (or None for the default), "
            f"got {value!r}"
        )


@dataclass(frozen=True)
class UcxOptions:
    """Parameters of NIXL's UCX backend, as kvlc creates it.

    ``num_threads``: UCX's worker thread pool that splits a request's descriptors across
    threads (None or 0: no pool, NIXL's default; see the module doc for the measurements).
    ``split_batch_size``: descriptors per chunk handed to a pool thread (None: 4 with a pool).
    ``num_workers``: UCX workers per agent (1 is NIXL's default; more gave nothing measured).
    ``error_handling``: endpoint error handling (None: NIXL's default, ``peer``).
    ``cuda_ipc_get_zcopy``: set ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` at agent creation when the
    user has not set it (fast READ between processes of one GPU node).
    ``extra``: further backend parameters passed through verbatim (strings), e.g.
    ``{"ucx_devices": "mlx5_0:1"}``.
    """

    num_threads: int | None = None
    split_batch_size: int | None = None
    num_workers: int = 1
    error_handling: ErrorHandling | None = None
    cuda_ipc_get_zcopy: bool = True
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _count("num_threads", self.num_threads, 0, 256)
        _count("split_batch_size", self.split_batch_size, 1, 1 << 20)
        _count("num_workers", self.num_workers, 1, 256)
        if self.error_handling is not None and not isinstance(self.error_handling, ErrorHandling):
            valid = [e.value for e in ErrorHandling]
            if self.error_handling not in valid:
                raise UcxOptionError(
                    f"UcxOptions.error_handling: got {self.error_handling!r}; "
                    f"{did_you_mean(str(self.error_handling), valid)}"
                )
            object.__setattr__(self, "error_handling", ErrorHandling(self.error_handling))
        if not isinstance(self.cuda_ipc_get_zcopy, bool):
            raise UcxOptionError(f"UcxOptions.cuda_ipc_get_zcopy: expected True or False, got "
                                 f"{self.cuda_ipc_get_zcopy!r}")
        bad = {k: v for k, v in dict(self.extra).items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise UcxOptionError(f"UcxOptions.extra: keys and values must be strings, got {bad!r}")
        taken = {"num_threads", "split_batch_size", "num_workers", "ucx_error_handling_mode"} & set(self.extra)
        if taken:
            raise UcxOptionError(
                f"UcxOptions.extra: {sorted(taken)} have typed fields; set UcxOptions.<field> instead"
            )
        object.__setattr__(self, "extra", dict(self.extra))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> UcxOptions:
        """Options from ``KVLC_UCX_NUM_THREADS`` / ``_SPLIT_BATCH_SIZE`` / ``_NUM_WORKERS`` (unset: default)."""
        env = os.environ if environ is None else environ
        kwargs = {}
        for var, name in ENV_FIELDS.items():
            if var in env:
                try:
                    kwargs[name] = int(env[var])
                except ValueError:
                    raise UcxOptionError(f"{var}={env[var]!r}: expected an integer") from None
        return cls(**kwargs)

    @classmethod
    def for_agent(cls, vram: bool, environ: Mapping[str, str] | None = None) -> UcxOptions:
        """The defaults of an agent created without options: :meth:`from_env`, plus UCX's thread pool
        (:data:`GPU_THREADS`) for one that holds VRAM when ``KVLC_UCX_NUM_THREADS`` is not set."""
        env = os.environ if environ is None else environ
        opts = cls.from_env(env)
        if vram and "KVLC_UCX_NUM_THREADS" not in env:
            opts = replace(opts, num_threads=GPU_THREADS)
        return opts

    def backend_params(self) -> dict[str, str]:
        """The string parameters for ``create_backend("UCX", ...)``."""
        params: dict[str, str] = {}
        threads = self.num_threads or 0
        if threads:
            params["num_threads"] = str(threads)
            params["split_batch_size"] = str(self.split_batch_size or DEFAULT_SPLIT_BATCH)
        elif self.split_batch_size is not None:
            params["split_batch_size"] = str(self.split_batch_size)
        params["num_workers"] = str(self.num_workers)
        if self.error_handling is not None:
            params["ucx_error_handling_mode"] = self.error_handling.value
        params.update(self.extra)
        return params


def cuda_visible() -> bool:
    """Whether torch (if already imported or importable) sees a CUDA device."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F811 - the runtime binds torch tensors; a CPU build answers False
        except ImportError:
            return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver reads as no GPU
        return False


def apply_env(
    options: UcxOptions, environ: MutableMapping[str, str] | None = None, cuda: bool | None = None
) -> dict[str, str]:
    """Set the UCX environment defaults ``options`` ask for, unless the user set them; returns what
    this call set. Call it just before the backend is created (UCX reads it then). Without a CUDA
    device (``cuda`` None: detect) nothing is set: UCX has no cuda_ipc transport to read it and
    would warn about an unused variable.

    >>> env = {}
    >>> apply_env(UcxOptions(), env, cuda=True)
    {'UCX_CUDA_IPC_ENABLE_GET_ZCOPY': 'y'}
    >>> apply_env(UcxOptions(), {GET_ZCOPY_ENV: "n"}, cuda=True)   # the user's value wins
    {}
    >>> apply_env(UcxOptions(), {}, cuda=False)
    {}
    """
    env = os.environ if environ is None else environ
    done: dict[str, str] = {}
    if options.cuda_ipc_get_zcopy and (cuda_visible() if cuda is None else cuda):
        current = env.get(GET_ZCOPY_ENV)
        if current is None:
            env[GET_ZCOPY_ENV] = "y"
            done[GET_ZCOPY_ENV] = "y"
            if env is os.environ:
                _set_by_kvlc.add(GET_ZCOPY_ENV)
            log.info("set %s=y (cuda_ipc READs between processes; UCX disables them without NVLink). "
                     "Set it yourself or pass UcxOptions(cuda_ipc_get_zcopy=False) to keep UCX's choice.",
                     GET_ZCOPY_ENV)
        elif not (env is os.environ and GET_ZCOPY_ENV in _set_by_kvlc):
            log.info("keeping the user's %s=%s", GET_ZCOPY_ENV, current)
    return done


def create_backends(nixl: Any, name: str, backends: Sequence[str], options: UcxOptions,
                    run: Callable[..., None]) -> dict[str, dict[str, str]]:
    """Create each of ``backends`` on a raw ``nixl_agent`` (UCX with ``options``, its environment set
    first); ``run`` is the NIXL choke point's call wrapper. Returns the parameters each got."""
    from kvlc.runtime.errors import NixlError

    plugins = sorted(nixl.get_plugin_list())
    missing = [b for b in backends if b not in plugins]
    if missing:
        raise NixlError(f"create agent {name!r}", "backend unavailable",
                        f"backends {missing} not loaded; available plugins: {plugins}")
    created = {}
    for b in backends:
        params: dict[str, str] = {}
        if b == "UCX":
            apply_env(options)  # UCX reads its environment when the backend is created
            params = options.backend_params()
        run(f"create backend {b} {params} for agent {name!r}", nixl.create_backend, b, params)
        created[b] = params
        log.debug("agent %r: backend %s created with %s", name, b, params)
    return created


__all__ = ["UcxOptions", "ErrorHandling", "UcxOptionError", "apply_env", "create_backends", "cuda_visible",
           "GET_ZCOPY_ENV"]
