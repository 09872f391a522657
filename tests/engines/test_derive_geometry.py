"""Derived specs hold the engine's bytes where the tensors hold them, for every backend layout.

The tensors are built with torch the way vLLM builds them (one flat allocation, a
permuted view per layer; older vLLM: one tensor per layer), content is written
through the *kernel's* view of each tensor (CPU_ATTN: ``view(B, H, 2N, D).chunk(2, 2)``;
FLASH_ATTN / FLASHINFER: ``transpose(1, 2).split(D, -1)``; split K/V: ``t[0], t[1]``;
MLA: ``t[:, 0]``), and every element is read back through the compiled plan's region
offsets, block strides, field offsets and dim strides. The CUDA layouts are vLLM's
published shapes built on CPU tensors: not run on a GPU here.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlc.engines.vllm.derive.spec import derive_plan, exact_plan
from kvlc.engines.vllm.derive.view import heads_per_rank
from kvlc.engines.vllm.derive.offline import published_view
from kvlc.engines.vllm.derive.read import layer_tensor

INT_OF = {"bf16": torch.int16, "fp16": torch.int16, "fp32": torch.int32, "fp8_e4m3": torch.int8}
NP_INT = {torch.int16: np.int16, torch.int32: np.int32, torch.int8: np.int8}
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
               "fp8_e4m3": torch.float8_e4m3fn}
UNIFIED_PHYSICAL = {"LBHNC": "LBHNC", "LBNHC": "LBNHC", "BLHNC": "BLHNC", "BLNHC": "BLNHC"}


def code(layer, kv, b, h, n, d):
    """A value that names its coordinate (unique for the sizes used here, within int16)."""
    return ((((layer * 2 + kv) * 7 + b) * 4 + h) * 67 + n) * 61 + d


def _unified_tensors(view, dtype):
    """One allocation; the logical [L, B, H, N, C] array stored in the layout's physical order."""
    t0 = view.layers[0]
    L = len(view.layers)
    B, H, N, C = t0.shape
    sizes = dict(L=L, B=B, H=H, N=N, C=C)
    physical = UNIFIED_PHYSICAL[view.kv_cache_layout]
    raw = torch.zeros(L * B * H * N * C * t0.itemsize, dtype=torch.uint8)
    phys = raw.view(dtype).view(*[sizes[c] for c in physical])
    logical = phys.permute(*[physical.index(c) for c in "LBHNC"])
    return raw, {t.name: logical[i] for i, t in enumerate(view.layers)}, [raw] * L


def _legacy_tensors(view, dtype):
    """One tensor per layer: FLASH_ATTN [2, B, N, H, D] / FLASHINFER [B, 2, N, H, D], HND by permute."""
    out, raws = {}, []
    for t in view.layers:
        shape = t.shape
        hnd = view.kv_cache_layout.endswith("HND")
        phys_shape = list(shape)
        if hnd:  # heads stored before tokens: physical [.., H, N, D], logical [.., N, H, D]
            phys_shape[2], phys_shape[3] = shape[3], shape[2]
        raw = torch.zeros(int(np.prod(shape)) * t.itemsize, dtype=torch.uint8)
        phys = raw.view(dtype).view(*phys_shape)
        out[t.name] = phys.permute(0, 1, 3, 2, 4) if hnd else phys
        raws.append(raw)
    return None, out, raws


def _from_torch(published, t):
    """The published layer with the torch tensor's addresses (older per-layer 5-dim tensors)."""
    st = t.untyped_storage()
    return dataclasses.replace(published, shape=tuple(t.shape), strides=tuple(t.stride()), data_ptr=t.data_ptr(),
                               storage_ptr=st.data_ptr(), storage_nbytes=st.nbytes())


def _kernel_views(view, tensor, head_dim):
    """(K, V) as the backend's kernels index them, each [B, N, H, D] (MLA: (latent [B, N, L],))."""
    if view.model.kv_lora_rank is not None:
        return (tensor[:, 0],)
    layout, backend = view.kv_cache_layout, view.backend
    if layout.startswith("split"):
        return tensor[0], tensor[1]
    if layout.startswith("blockkv"):
        return tensor[:, 0], tensor[:, 1]
    if backend == "CPU_ATTN":
        B, H, N, _ = tensor.shape
        k, v = tensor.view(B, H, 2 * N, head_dim).chunk(2, dim=2)
        return k.transpose(1, 2), v.transpose(1, 2)
    return tensor.transpose(1, 2).split(head_dim, dim=-1)


def _fill(view, kernel_views):
    """Write code(layer, kv, b, h, n, d) into every element through the kernels' views."""
    for li, per_kv in enumerate(kernel_views):
        for kv, x in enumerate(per_kv):
            xi = x.view(INT_OF[view.model.dtype])
            if x.dim() == 3:  # MLA latent [B, N, L]
                b, n, d = np.meshgrid(*[np.arange(s) for s in x.shape], indexing="ij")
                xi.copy_(torch.from_numpy(code(li, 0, b, 0, n, d).astype(NP_INT[xi.dtype])))
                continue
            b, n, h, d = np.meshgrid(*[np.arange(s) for s in x.shape], indexing="ij")
            xi.copy_(torch.from_numpy(code(li, kv, b, h, n, d).astype(NP_INT[xi.dtype])))


def _read_back(plan, view, raws):
    """Every element of every region, read at the plan's addresses, compared with its code."""
    from kvlc.engines.vllm.derive.storages import allocations
    by_ptr = {raw.data_ptr(): raw for raw in raws}
    storage_raw = {a.name: by_ptr[a.ptr] for a in allocations(view)}
    checked = 0
    for r in plan.regions:
        li = int(r.name.split(".")[1])
        buf = storage_raw[r.storage].numpy()
        for f in r.fields:
            item = f.itemsize
            grids = np.meshgrid(np.arange(r.num_blocks), *[np.arange(d.size) for d in f.dims], indexing="ij")
            addr = r.offset + grids[0] * r.block_stride + f.offset
            coords = {"kv": {"k": 0, "v": 1}.get(f.name, 0), "head": 0, "token": 0, "head_dim": 0}
            for g, d in zip(grids[1:], f.dims):
                addr = addr + g * d.stride
                if d.name == "cell":  # a K or V half in the order the test wrote it: [token][head_dim]
                    coords["token"], coords["head_dim"] = np.divmod(g, view.model.head_dim)
                else:
                    coords["head_dim" if d.name == "latent" else d.name] = g
            # a kernel block of the plan = one tensor block; tokens as the kernel indexes them
            want = code(li, coords["kv"], grids[0], coords["head"], coords["token"], coords["head_dim"])
            np_int = NP_INT[INT_OF[f.dtype]]
            got = np.stack([buf[addr + i] for i in range(item)], axis=-1).copy().view(np_int)[..., 0]
            np.testing.assert_array_equal(got, want.astype(np_int), err_msg=f"{r.name}.{f.name}")
            checked += got.size
    return checked


CASES = [("CPU_ATTN", "LBHNC"), ("FLASH_ATTN", "LBNHC"), ("FLASH_ATTN", "LBHNC"), ("FLASHINFER", "LBHNC"),
         ("FLASHINFER", "BLHNC"), ("FLASH_ATTN", "BLNHC"), ("FLASH_ATTN", "split-NHD"),
         ("FLASH_ATTN", "split-HND"), ("FLASHINFER", "blockkv-NHD"), ("FLASHINFER", "blockkv-HND"),
         ("FLASHMLA", "LBHNC"), ("TRITON_MLA", "LBHNC")]


def _check_case(backend, layout, heads, tp, head_dim, block, ratio, layers, dtype):
    mla = backend.endswith("MLA")
    cfg = {"num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": heads,
           "head_dim": head_dim}
    if mla:
        cfg.update(kv_lora_rank=head_dim - 4, qk_rope_head_dim=4)
    view = published_view(cfg, "m", backend=backend, block_size=block * ratio, kernel_block_size=block,
                          num_blocks=3, tp_size=tp, kv_dtype=dtype, layout=layout, device="cpu")
    builder = _legacy_tensors if layout.startswith(("split", "blockkv")) else _unified_tensors
    _, tensors, raws = builder(view, TORCH_DTYPE[dtype])
    if builder is _unified_tensors:  # what register_kv_caches receives, read as the engine reader does
        live = tuple(layer_tensor(t.name, tensors[t.name], mla) for t in view.layers)
    else:
        live = tuple(_from_torch(t, tensors[t.name]) for t in view.layers)
    for mine, torch_made in zip(view.layers, live):  # published strides = torch's strides of the same layout
        assert (mine.axes, mine.shape, mine.strides) == (torch_made.axes, torch_made.shape, torch_made.strides)
        if builder is _unified_tensors:
            assert mine.offset == torch_made.offset
    live_view = dataclasses.replace(view, layers=live)
    plan = derive_plan(live_view)
    if mla and builder is _unified_tensors:  # an MLA layer's own view drops the head: the same plan
        squeezed = tuple(layer_tensor(t.name, tensors[t.name][:, 0], mla=True) for t in view.layers)
        assert derive_plan(dataclasses.replace(view, layers=squeezed)).text() == plan.text()
    _fill(live_view, [_kernel_views(live_view, tensors[t.name], view.model.head_dim) for t in view.layers])
    n = _read_back(plan, live_view, raws)
    per_rank_heads = 1 if mla else heads_per_rank(heads, tp)
    assert n == layers * 3 * ratio * block * per_rank_heads * (head_dim if mla else 2 * head_dim)


@pytest.mark.parametrize("backend,layout", CASES, ids=[f"{b}-{lay}" for b, lay in CASES])
def test_every_element_is_where_the_plan_says(backend, layout):
    """Each element written through the kernel's view is read back at the plan's address."""
    _check_case(backend, layout, heads=4, tp=2, head_dim=16, block=16, ratio=1, layers=3, dtype="bf16")


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(CASES), heads=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([8, 16, 32]), block=st.sampled_from([4, 8, 32]), ratio=st.sampled_from([1, 2]),
       layers=st.integers(1, 3), dtype=st.sampled_from(["bf16", "fp32", "fp16"]))
def test_random_geometries_hold_every_element(case, heads, tp, head_dim, block, ratio, layers, dtype):
    """Over random heads, TP (GQA replicas too), sizes, kernel blocks and dtypes: every element round-trips."""
    backend, layout = case
    if layout.startswith(("split", "blockkv")) and ratio > 1:
        ratio = 1  # older vLLM had no kernel blocks
    _check_case(backend, layout, heads, tp, head_dim, block, ratio, layers, dtype)


@pytest.mark.parametrize("heads,tp,block", [(4, 1, 32), (4, 2, 128), (2, 4, 64)])
def test_cpu_exact_plan_reads_k_transposed_and_v(heads, tp, block):
    """exact_plan's k/v fields hold K stored transposed ([head_dim][token]) and V ([token][head_dim])
    in each head's halves, as the CPU kernels' vec ISA stores them: every element read back."""
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": heads, "head_dim": 16}
    view = published_view(cfg, "m", backend="CPU_ATTN", block_size=block, num_blocks=3, tp_size=tp,
                          kv_dtype="bf16", cpu_isa="vec")
    _, tensors, raws = _unified_tensors(view, torch.bfloat16)
    live = dataclasses.replace(view, layers=tuple(layer_tensor(t.name, tensors[t.name]) for t in view.layers))
    for li, t in enumerate(view.layers):
        x = tensors[t.name]
        B, H, N, C = x.shape
        halves = x.view(torch.int16).view(B, H, 2, N * 16)
        b, h, d, n = np.meshgrid(np.arange(B), np.arange(H), np.arange(16), np.arange(N), indexing="ij")
        halves[:, :, 0].view(B, H, 16, N).copy_(torch.from_numpy(code(li, 0, b, h, n, d).astype(np.int16)))
        b, h, n, d = np.meshgrid(np.arange(B), np.arange(H), np.arange(N), np.arange(16), indexing="ij")
        halves[:, :, 1].view(B, H, N, 16).copy_(torch.from_numpy(code(li, 1, b, h, n, d).astype(np.int16)))
    plan = exact_plan(live)
    assert [f.name for f in plan.regions[0].fields] == ["k", "v"]
    assert _read_back(plan, live, raws) == 2 * 3 * block * heads_per_rank(heads, tp) * 2 * 16
