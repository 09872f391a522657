"""The allocations behind an engine's layer tensors: one kvlc storage each, and the tensors to bind.

vLLM 0.32 puts every layer of a KV-cache group in one allocation (consecutive slabs);
each layer tensor is a view of it. A storage is named ``kv`` when there is one
allocation, ``kv.{first layer}`` otherwise.

>>> from kvlc.engines.vllm.derive.view import EngineView, EXAMPLE
>>> [(a.name, a.nbytes, len(a.layers)) for a in allocations(EngineView.from_dict(EXAMPLE))]
[('kv', 262144, 2)]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlc.engines.vllm.derive.view import EngineView, LayerTensor, ViewError
from kvlc.errors import did_you_mean
from kvlc.errors import BindingError


@dataclass(frozen=True)
class Allocation:
    """One allocation the layer tensors are views of: one kvlc storage."""

    name: str
    ptr: int
    nbytes: int
    mem: str
    device: int
    layers: tuple[str, ...]


def _mem(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    if kind == "cpu":
        return "DRAM", 0
    if kind == "cuda":
        return "VRAM", int(index or 0)
    raise ViewError(f"tensor device '{device}': kvlc places storages in DRAM (cpu) or VRAM (cuda:N)")


def allocations(view: EngineView) -> tuple[Allocation, ...]:
    """The view's allocations in layer order: ``kv`` when there is one, else ``kv.{first layer}``."""
    found: dict[tuple[str, int], list[LayerTensor]] = {}
    for t in sorted(view.layers, key=lambda t: t.layer_index):
        found.setdefault((t.device, t.storage_ptr), []).append(t)
    out = []
    for (device, ptr), members in found.items():
        name = "kv" if len(found) == 1 else f"kv.{members[0].layer_index}"
        mem, dev = _mem(device)
        out.append(Allocation(name, ptr, members[0].storage_nbytes, mem, dev, tuple(t.name for t in members)))
    return tuple(out)


def _storage_tensor(name: str, a: Allocation | None, allocs, kv_caches: Mapping[str, Any]) -> tuple[Any, str]:
    """(uint8 tensor over allocation ``a``, "") or (None, why not)."""
    import torch

    if a is None:
        return None, f"storage '{name}': the engine has no such allocation ({did_you_mean(name, allocs)})"
    t = next((kv_caches[n] for n in a.layers if n in kv_caches), None)
    if t is None or not hasattr(t, "untyped_storage"):
        return None, (f"storage '{name}': none of its layer tensors ({', '.join(a.layers[:3])}...) is in "
                      "kv_caches; pass the dict given to register_kv_caches")
    st = t.untyped_storage()
    if st.data_ptr() != a.ptr or st.nbytes() != a.nbytes:
        return None, (f"storage '{name}': tensor '{a.layers[0]}' lies in an allocation at {st.data_ptr():#x} of "
                      f"{st.nbytes()} bytes; the view says {a.ptr:#x}, {a.nbytes} bytes; fix: build the view "
                      "from these kv_caches")
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,)), ""


def storage_tensors(plan: Any, view: EngineView, kv_caches: Mapping[str, Any]) -> dict:
    """Storage name → uint8 tensor over the whole allocation, for :func:`kvlc.runtime.binding.bind`."""
    allocs = {a.name: a for a in allocations(view)}
    out, problems = {}, []
    for s in plan.storages:
        tensor, why = _storage_tensor(s.name, allocs.get(s.name), allocs, kv_caches)
        if tensor is None:
            problems.append(why)
        else:
            out[s.name] = tensor
    if problems:
        raise BindingError("\n".join([f"cannot bind plan '{plan.name}' to the engine's tensors:"]
                                     + ["  " + p for p in problems]))
    return out
