"""Binding: check the tensors an engine allocated against its plan's storages.

One tensor per storage, by name: present, contiguous, of the storage's memory
type and device (DRAM: a CPU tensor; VRAM: a CUDA tensor on the storage's
device), and at least the storage's size in bytes. Every problem is reported at
once, each naming the storage, what the plan expects and what the tensor has.
Tensors are duck-typed (``device``, ``is_contiguous``, ``data_ptr``, ``numel``,
``element_size``), so this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlc.compiler.plan import Plan, PlanStorage
from kvlc.runtime.errors import BindingError


@dataclass(frozen=True)
class Bound:
    """A storage with the tensor backing it: base address, bytes and the NIXL device id."""

    storage: PlanStorage
    tensor: Any
    addr: int
    nbytes: int
    device: int

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def mem(self) -> str:
        return self.storage.mem

    def row(self) -> np.ndarray:
        """The (1, 3) registration row (addr, len, dev) covering the whole tensor."""
        return np.array([[self.addr, self.nbytes, self.device]], dtype=np.uint64)


def _describe(t: Any) -> str:
    return f"{getattr(t, 'dtype', '?')} tensor of shape {tuple(getattr(t, 'shape', ()))} on {t.device}"


def _check_one(s: PlanStorage, t: Any) -> tuple[Bound | None, list[str]]:
    problems = []
    dev = getattr(t, "device", None)
    if dev is None or not hasattr(t, "data_ptr"):
        return None, [f"storage '{s.name}': expected a torch tensor, got {type(t).__name__}"]
    kind, index = dev.type, dev.index
    if s.mem == "DRAM" and kind != "cpu":
        problems.append(f"storage '{s.name}': plan says DRAM, so a CPU tensor; got a {_describe(t)}")
    if s.mem == "VRAM":
        if kind != "cuda":
            problems.append(
                f"storage '{s.name}': plan says VRAM on device {s.device}, so a "
                f"cuda:{s.device} tensor; got a {_describe(t)}"
            )
        elif (index or 0) != s.device:
            problems.append(
                f"storage '{s.name}': plan says device {s.device}; got a tensor on cuda:{index or 0}"
            )
    if not t.is_contiguous():
        problems.append(
            f"storage '{s.name}': tensor must be contiguous (one registration); "
            f"got strides {tuple(t.stride())}; fix: pass tensor.contiguous() at allocation"
        )
    nbytes = int(t.numel()) * int(t.element_size())
    if nbytes < s.size:
        problems.append(
            f"storage '{s.name}': plan needs {s.size} bytes; tensor has {nbytes} ({_describe(t)})"
        )
    if problems:
        return None, problems
    device = (index or 0) if s.mem == "VRAM" else 0
    return Bound(s, t, int(t.data_ptr()), nbytes, device), []


def bind(plan: Plan, tensors: Mapping[str, Any]) -> dict[str, Bound]:
    """Check every storage's tensor; return storage name → :class:`Bound`, in plan order.

    Raises :class:`BindingError` listing every problem.
    """
    problems: list[str] = []
    out: dict[str, Bound] = {}
    names = [s.name for s in plan.storages]
    for s in plan.storages:
        if s.name not in tensors:
            problems.append(f"storage '{s.name}': no tensor given ({s.mem}:{s.device}, {s.size} bytes)")
            continue
        bound, errs = _check_one(s, tensors[s.name])
        problems.extend(errs)
        if bound is not None:
            out[s.name] = bound
    extra = [k for k in tensors if k not in set(names)]
    if extra:
        shown = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
        problems.append(f"tensor(s) {extra} match no storage of plan '{plan.name}' (storages: {shown})")
    if problems:
        head = f"{len(problems)} binding problem{'s' if len(problems) > 1 else ''} for plan '{plan.name}':"
        raise BindingError("\n".join([head] + ["  " + p for p in problems]))
    return out


def allocate(plan: Plan, pin: bool = False) -> dict[str, Any]:
    """Zeroed uint8 tensors sized for every storage: CPU for DRAM (pinned if ``pin``), ``cuda:N`` for VRAM."""
    import torch

    out = {}
    for s in plan.storages:
        if s.mem == "DRAM":
            out[s.name] = torch.zeros(s.size, dtype=torch.uint8, pin_memory=pin)
        else:
            out[s.name] = torch.zeros(s.size, dtype=torch.uint8, device=f"cuda:{s.device}")
    return out
