"""Binding: check the tensors an engine allocated against its plan's storages.

One tensor per storage, by name: present, contiguous, of the storage's memory
type and device (DRAM: a CPU tensor; VRAM: a CUDA tensor on the storage's
device), and at least the storage's size in bytes. Every problem is reported at
once, each naming the storage, what the plan expects and what the tensor has.

No two storages may be bound to overlapping memory: the compiler checks overlap (and
declared ``aliases``) only between regions of one storage, so two storages over the same
bytes would let two regions write them unchecked. The bytes that count are the ones the
plan can touch, ``[data_ptr, data_ptr + storage size)`` on one (memory type, device); a
tensor longer than its storage is registered whole, and that tail may overlap another
storage (NIXL accepts overlapping registrations). Storages that really share an
allocation are declared as one storage with a region per part, and regions that share
pages on purpose declare ``aliases`` (:mod:`kvlc.compiler.plan.aliases`).

Tensors are duck-typed (``device``, ``is_contiguous``, ``data_ptr``, ``numel``,
``element_size``), so this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlc.compiler.plan.model import Plan, PlanStorage
from kvlc.runtime.errors import BindingError
from kvlc.runtime.shm import shared_dram


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

    @property
    def stop(self) -> int:
        """One past the last byte the plan can touch (``addr`` + the storage's size)."""
        return self.addr + self.storage.size

    def row(self) -> np.ndarray:
        """The (1, 3) registration row (addr, len, dev) covering the whole tensor."""
        return np.array([[self.addr, self.nbytes, self.device]], dtype=np.uint64)


@dataclass(frozen=True)
class Overlap:
    """Two bound storages whose plan bytes share ``[start, stop)`` (``first`` starts no later)."""

    first: Bound
    second: Bound

    @property
    def start(self) -> int:
        return self.second.addr

    @property
    def stop(self) -> int:
        return min(self.first.stop, self.second.stop)

    def text(self) -> str:
        a, b = self.first, self.second

        def where(x: Bound) -> str:
            return f"'{x.name}' at [{x.addr:#x}, {x.stop:#x})"

        return (f"storages '{a.name}' and '{b.name}' are bound to overlapping memory on {a.mem}:{a.device}: "
                f"{where(a)} and {where(b)} share {self.stop - self.start} bytes [{self.start:#x}, "
                f"{self.stop:#x}); the compiler checks overlap only between regions of one storage; fix: "
                f"declare one storage for the allocation with a region per part ('{b.name}' at offset "
                f"{b.addr - a.addr} of '{a.name}'), and 'aliases' between regions that really share pages")


def overlaps(bounds: Iterable[Bound]) -> list[Overlap]:
    """Every pair of bound storages whose plan bytes overlap on one (memory type, device), by address.

    Exact on ``[addr, addr + storage size)``: adjacent ranges and equal bases of disjoint
    views do not overlap; a sweep over the sorted starts, so disjoint storages cost n log n.
    """
    out: list[Overlap] = []
    active: dict[tuple[str, int], list[Bound]] = {}
    for b in sorted(bounds, key=lambda x: (x.mem, x.device, x.addr, x.stop)):
        if b.stop <= b.addr:
            continue
        key = (b.mem, b.device)
        live = [a for a in active.get(key, ()) if a.stop > b.addr]
        out.extend(Overlap(a, b) for a in live)
        active[key] = live + [b]
    return out


MAX_SHOWN = 8  # overlapping pairs spelled out in one binding error


def _overlap_problems(bound: Mapping[str, Bound]) -> list[str]:
    found = overlaps(bound.values())
    more = len(found) - MAX_SHOWN
    return [o.text() for o in found[:MAX_SHOWN]] + ([f"... and {more} more overlapping pairs"] if more > 0 else [])


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

    Raises :class:`BindingError` listing every problem, overlapping storages included
    (:func:`overlaps`).
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
    problems.extend(_overlap_problems(out))
    extra = [k for k in tensors if k not in set(names)]
    if extra:
        shown = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
        problems.append(f"tensor(s) {extra} match no storage of plan '{plan.name}' (storages: {shown})")
    if problems:
        head = f"{len(problems)} binding problem{'s' if len(problems) > 1 else ''} for plan '{plan.name}':"
        raise BindingError("\n".join([head] + ["  " + p for p in problems]))
    return out


def allocate(plan: Plan, pin: bool = False, shared: bool = False) -> dict[str, Any]:
    """Zeroed uint8 tensors sized for every storage: CPU for DRAM (pinned if ``pin``; in a shared-memory
    file a same-host peer can map if ``shared``, :mod:`kvlc.runtime.shm`), ``cuda:N`` for VRAM."""
    import torch

    out = {}
    for s in plan.storages:
        if s.mem == "DRAM" and shared and not pin:
            out[s.name] = shared_dram(s.size, f"kvlc-{s.name}")
        elif s.mem == "DRAM":
            out[s.name] = torch.zeros(s.size, dtype=torch.uint8, pin_memory=pin)
        else:
            out[s.name] = torch.zeros(s.size, dtype=torch.uint8, device=f"cuda:{s.device}")
    return out
