"""A hybrid's state layer: its layout from the model config, and a live engine's state tensors checked against it.

:func:`state_layout` is one Mamba-1 / Mamba-2 / Gated-DeltaNet layer's state as vLLM 0.32 keeps it, from
the HuggingFace config (see :mod:`kvlc.engines.vllm.derive.hybrid` for the page pool around it);
``kvlc init`` and the live derivation both take it from here.

vLLM 0.32 hands a connector a state layer as ``[conv, ssm]`` tensors, each ``[blocks, ...]``
over the layer's slab of the hybrid page pool: block ``b`` of the layer is one request's state,
its conv taps (``[taps, channels]``, taps outer) then its SSM / recurrent state, packed at the
start of a page of the attention page size. The spec states each layer as one region of the
model's :class:`~kvlc.engines.vllm.derive.view.StateLayout` (the layout ``kvlc init`` writes from
the config, :mod:`kvlc.engines.vllm.derive.hybrid`); this module checks that the tensors are laid
out exactly so (shape, dtype, packing, page stride, block count) before a region names them.

>>> conv_bytes(StateLayout("s", 3, (("x", 8), ("B", 4)), "bf16", "ssm", (("h", 2, True),), "fp32"), tp=2)
36
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvlc.compiler.spec.dtypes import DTYPE_SIZES
from kvlc.engines.vllm.derive.view import EngineView, StateLayout, StateTensors, ViewError


TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "bf16": "bf16", "fp16": "fp16",
                "fp32": "fp32"}

def _dtype(value: Any, where: str) -> str:
    if str(value) not in TORCH_DTYPES:
        raise ViewError(f"config.json: {where} {value!r} is not a dtype kvlc knows; expected one of "
                        f"{sorted(set(TORCH_DTYPES))}")
    return TORCH_DTYPES[str(value)]


SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")   # vLLM's --mamba-ssm-cache-dtype
# A one-group Mamba-2 (n_groups 1, e.g. Falcon-H1): vLLM 0.32 gives every TP rank the whole group's B and C
# (MambaMixer2's extra_groups_for_head_shards), so a rank's conv channels are x / tp | B | C.
ONE_GROUP = ("B", "C")


def ssm_dtype(c: Mapping[str, Any], kind: str, model: str, *, requested: str = "auto",
              cpu_avx512_bf16: bool = False) -> str:
    """The dtype vLLM 0.32 keeps a ``mamba`` / ``linear`` layer's SSM (recurrent) state in.

    ``requested`` is the engine's ``--mamba-ssm-cache-dtype``; ``cpu_avx512_bf16`` says the
    engine runs on vLLM's CPU platform on a CPU with AVX-512 BF16 (see the module docstring).
    """
    want = _configured_ssm_dtype(c, kind, requested)
    if cpu_avx512_bf16:
        want = _cpu_platform_ssm_dtype(kind, want)
    return want or model


def _configured_ssm_dtype(c: Mapping[str, Any], kind: str, requested: str) -> str | None:
    """The flag, else the model's own default (vLLM's per-model config hooks); None: the model dtype."""
    if requested not in SSM_CACHE_DTYPES:
        raise ViewError(f"--mamba-ssm-cache-dtype {requested!r} is not one of vLLM's "
                        f"{list(SSM_CACHE_DTYPES)}; fix: pass one of them")
    if requested != "auto":
        return TORCH_DTYPES[requested]
    hooked = kind in ("mamba", "linear")   # vLLM's config hooks (Nemotron-H, Qwen3.5); Jamba and Falcon-H1 have none
    hf = hooked and (c.get("mamba_ssm_cache_dtype") or c.get("mamba_ssm_dtype"))
    if hf:
        return _dtype(hf, "mamba_ssm_cache_dtype")
    return "fp32" if kind == "mamba" else None


def _cpu_platform_ssm_dtype(kind: str, want: str | None) -> str:
    """vLLM's CPU platform on an AVX-512 BF16 CPU: fp32, except a half Gated-DeltaNet state asked for."""
    if want in ("bf16", "fp16") and kind == "linear":
        return want
    if kind == "mamba2":   # Falcon-H1's transformers config names its layers "hybrid": vLLM resets it to fp32
        return "fp32"
    if want in ("bf16", "fp16"):
        raise ViewError(f"a {want} {'Mamba-1' if kind == 'mamba1' else 'Mamba-2'} state on vLLM's CPU platform with AVX-512 BF16: vLLM 0.32 keeps it "
                        "only when the engine's transformers names Mamba layers 'linear_attention' (transformers "
                        "5 does, 4.x does not) and resets it to float32 otherwise, which config.json cannot tell; "
                        "fix: --mamba-ssm-cache-dtype float32")
    return "fp32"


def _count(c: Mapping[str, Any], key: str) -> int:
    value = c.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ViewError(f"config.json: '{key}' must be a non-negative integer, found {value!r}; "
                        f"fix: give the model's {key} as in its HuggingFace config.json")
    return value


def mamba2_fields(c: Mapping[str, Any]) -> Mapping[str, Any]:
    """Text config ``c`` with a Falcon-H1 Mamba-2 mixer's fields spelled as Nemotron-H's, which
    :func:`state_layout` and :func:`check_state_split` read; a config without ``mamba_n_heads`` (or with
    Nemotron-H's ``mamba_num_heads``) unchanged. ``kvlc init`` and the live derivation both translate here.

    As vLLM 0.32's ``FalconH1ForCausalLM.get_mamba_state_shape_from_config`` reads them: ``mamba_d_ssm``
    channels (``mamba_expand * hidden_size`` when it is null), ``mamba_n_heads`` heads of ``mamba_d_head``
    (``"auto"``: channels / heads, as transformers' FalconH1Config resolves it), ``mamba_n_groups`` groups of
    ``mamba_d_state`` states, ``mamba_d_conv`` taps.

    >>> t = mamba2_fields({"hidden_size": 256, "mamba_d_ssm": None, "mamba_expand": 2, "mamba_n_heads": 16,
    ...                    "mamba_d_head": "auto", "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4})
    >>> [t[k] for k in ("conv_kernel", "n_groups", "mamba_num_heads", "mamba_head_dim", "ssm_state_size")]
    [4, 2, 16, 32, 16]
    """
    if c.get("mamba_n_heads") is None or "mamba_num_heads" in c:
        return c
    d_ssm = _count(c, "mamba_d_ssm") if c.get("mamba_d_ssm") is not None else \
        _count(c, "mamba_expand") * _count(c, "hidden_size")
    heads = _count(c, "mamba_n_heads")
    auto = c.get("mamba_d_head", "auto") == "auto"
    head_dim = d_ssm // heads if auto and heads else _count(c, "mamba_d_head")
    if heads * head_dim != d_ssm:
        raise ViewError(f"config.json: mamba_n_heads {heads} x mamba_d_head {head_dim} must equal the Mamba "
                        f"intermediate size {d_ssm} (mamba_d_ssm, or mamba_expand * hidden_size), as transformers' "
                        "FalconH1Config requires; fix: give the model's values")
    return {**c, "conv_kernel": _count(c, "mamba_d_conv"), "n_groups": _count(c, "mamba_n_groups"),
            "mamba_num_heads": heads, "mamba_head_dim": head_dim, "ssm_state_size": _count(c, "mamba_d_state")}


def state_layout(c: Mapping[str, Any], kind: str, *, requested: str = "auto",
                 cpu_avx512_bf16: bool = False) -> StateLayout:
    """The state of one layer of kind ``mamba`` / ``mamba2`` (Mamba-2), ``mamba1``, ``linear`` or ``short_conv`` of text
    config ``c`` as vLLM 0.32 keeps it (``requested`` and ``cpu_avx512_bf16``: see :func:`ssm_dtype`).

    A short convolution (LFM2, vLLM's ``short_conv_state_shape``) keeps only its conv taps: ``conv_L_cache - 1``
    taps over ``conv_dim`` channels, in the model dtype.

    >>> s = state_layout({"conv_L_cache": 3, "conv_dim": 256, "torch_dtype": "float32"}, "short_conv")
    >>> s.layout()["fields"][0]["dims"], s.bytes_per_rank(2)
    ([{'name': 'conv_tap', 'size': 2}, {'name': 'channel', 'role': 'head', 'sections': {'x': 256}}], 1024)
    """
    model = _dtype(c.get("torch_dtype") or c.get("dtype") or "bfloat16", "torch_dtype")
    if kind == "short_conv":
        return StateLayout("short_conv_state", int(c["conv_L_cache"]) - 1, (("x", int(c["conv_dim"])),), model,
                           "", (), model)
    ssm = ssm_dtype(c, kind, model, requested=requested, cpu_avx512_bf16=cpu_avx512_bf16)
    if kind == "mamba1":
        d_inner = int(c["mamba_expand"]) * int(c["hidden_size"])
        return StateLayout("mamba1_state", int(c["mamba_d_conv"]) - 1, (("x", d_inner),), model, "ssm",
                           (("channel", d_inner, True), ("ssm_state", int(c["mamba_d_state"]), False)), ssm)
    if kind in ("mamba", "mamba2"):
        bc = int(c["n_groups"]) * int(c["ssm_state_size"])
        return StateLayout("mamba2_state", int(c["conv_kernel"]) - 1,
                           (("x", int(c["mamba_num_heads"]) * int(c["mamba_head_dim"])), ("B", bc), ("C", bc)),
                           model, "ssm", (("ssm_head", int(c["mamba_num_heads"]), True),
                                          ("mamba_head_dim", int(c["mamba_head_dim"]), False),
                                          ("ssm_state", int(c["ssm_state_size"]), False)), ssm,
                           ONE_GROUP if int(c["n_groups"]) == 1 else ())
    kd = int(c["linear_num_key_heads"]) * int(c["linear_key_head_dim"])
    return StateLayout("gdn_state", int(c["linear_conv_kernel_dim"]) - 1,
                       (("q", kd), ("k", kd), ("v", int(c["linear_num_value_heads"]) * int(c["linear_value_head_dim"]))),
                       model, "recurrent", (("v_head", int(c["linear_num_value_heads"]), True),
                                            ("v_dim", int(c["linear_value_head_dim"]), False),
                                            ("k_dim", int(c["linear_key_head_dim"]), False)), ssm)


def check_state_split(state: StateLayout, c: Mapping[str, Any], tp: int) -> None:
    """TP splits every state section and head count evenly, except a one-group Mamba-2's B and C, which every
    rank holds whole (``replicated``); vLLM 0.32's ``MambaMixer2`` allows no other ``n_groups``."""
    groups = c.get("n_groups")
    if state.name == "mamba2_state" and int(groups) % tp and int(groups) != 1:
        raise ViewError(f"tp_size {tp} does not divide the model's n_groups {groups}, which is not 1; vLLM 0.32 "
                        "refuses it too (MambaMixer2 wants n_groups % tp_size == 0 or n_groups == 1); fix: a "
                        f"tp_size that divides {groups}")
    sections = tuple((n, s) for n, s in state.sections if n not in state.replicated)
    for name, size in sections + tuple((n, s) for n, s, sharded in state.rec_dims if sharded):
        if size % tp:
            raise ViewError(f"tp_size {tp} does not divide the state's '{name}' ({size}); vLLM refuses it too; "
                            "fix: a tp_size that divides every state section and head count")


def conv_bytes(state: StateLayout, tp: int) -> int:
    """Bytes of one request's conv state on one TP rank (taps x this rank's channels)."""
    return state.conv_taps * sum(size for _, size in state.section_sizes(tp)) * DTYPE_SIZES[state.conv_dtype]


def _want_shapes(state: StateLayout, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    conv = (state.conv_taps, sum(size for _, size in state.section_sizes(tp)))
    rec = tuple(size // tp if sharded else size for _, size, sharded in state.rec_dims)
    return conv, rec


def _dense(t) -> bool:
    """Whether one block of ``t`` is one dense row-major run of elements."""
    step = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.strides[1:]))):
        if size > 1 and stride != step:
            return False
        step *= size
    return True


def _problems(s: StateTensors, state: StateLayout, view: EngineView) -> list[str]:
    if len(s.parts) != state.parts:
        return [f"{len(s.parts)} tensor(s), a {state.name} has {state.parts}"]
    tp = view.parallel.tp_size
    want_conv, want_rec = _want_shapes(state, tp)
    checks = ((s.parts[0], want_conv, state.conv_dtype, "conv"),)
    if state.rec_field:
        checks += ((s.parts[1], want_rec, state.rec_dtype, state.rec_field),)
    out = []
    for t, shape, dtype, what in checks:
        if tuple(t.shape[1:]) != shape:
            out.append(f"{what} state shape {t.shape[1:]}, the config says {shape} per rank (tp_size {tp})")
        if t.dtype != dtype:
            out.append(f"{what} state dtype {t.dtype}, expected {dtype}")
        if not _dense(t):
            out.append(f"{what} state strides {t.strides} are not dense inside a block")
        if t.shape[0] != view.num_blocks:
            out.append(f"{what} state has {t.shape[0]} blocks, the engine {view.num_blocks}")
    return out + (_packed(*s.parts, state, tp) if state.rec_field else [])


def _packed(conv, rec, state: StateLayout, tp: int) -> list[str]:
    """How a layer's recurrent state does not follow its conv taps in one page (nothing: it does)."""
    out = []
    page = conv.strides[0] * conv.itemsize
    if rec.strides[0] * rec.itemsize != page:
        out.append(f"conv and {state.rec_field} pages differ ({page} vs {rec.strides[0] * rec.itemsize} bytes)")
    if rec.data_ptr - conv.data_ptr != conv_bytes(state, tp):
        out.append(f"{state.rec_field} starts {rec.data_ptr - conv.data_ptr} bytes after conv, expected "
                   f"{conv_bytes(state, tp)} (packed right after it)")
    if conv.storage_ptr != rec.storage_ptr:
        out.append("conv and ssm lie in different allocations")
    return out


def _refuse_dim_first_conv(s: StateTensors, state: StateLayout, tp: int) -> None:
    """vLLM 0.32 keeps conv states ``(taps, channels)`` ("SD"), or ``(channels, taps)`` ("DS") when
    ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` (``model_executor/layers/mamba/mamba_utils.py``), which its CPU platform
    sets for NixlConnector engines only (``platforms/cpu.py``); kvlc states the SD layout."""
    conv, want = tuple(s.parts[0].shape[1:]), _want_shapes(state, tp)[0]
    if conv != want and conv == want[::-1]:
        raise ViewError(f"state layer '{s.name}': conv state shape {conv} is channels first, vLLM's 'DS' conv "
                        f"layout (VLLM_SSM_CONV_STATE_LAYOUT=DS); kvlc states the 'SD' layout {want} (taps outer) "
                        "vLLM's CPU platform picks for engines without NixlConnector; fix: start the engine "
                        "without VLLM_SSM_CONV_STATE_LAYOUT=DS (or with SD), on both sides")


def check_state_tensors(s: StateTensors, view: EngineView) -> None:
    """Raise :class:`ViewError` naming every way the layer's tensors differ from the model's state layout."""
    if view.state is None:
        raise ViewError(f"kv_caches['{s.name}'] is a state layer but the engine has no Mamba / linear-attention "
                        "KV-cache group; fix: derive from the kv_caches of the engine's own register_kv_caches")
    _refuse_dim_first_conv(s, view.state, view.parallel.tp_size)
    problems = _problems(s, view.state, view)
    if problems:
        raise ViewError(f"state layer '{s.name}' is not laid out as vLLM 0.32 lays out a {view.state.name} "
                        "(conv taps then the state, packed at the start of each page): " + "; ".join(problems)
                        + "; fix: report this engine's vLLM version and model")


def state_region(s: StateTensors, view: EngineView, storage: str, group: str) -> dict:
    """The spec region of one state layer (``layer.{i}``, one block per request, the page as its stride)."""
    check_state_tensors(s, view)
    conv = s.parts[0]
    return {"name": f"layer.{s.layer_index}", "storage": storage, "layout": view.state.name,
            "num_blocks": conv.shape[0], "offset": conv.offset, "block_stride": conv.strides[0] * conv.itemsize,
            "groups": [group]}


def placements(view: EngineView) -> list[tuple[str, int, str, int]]:
    """(name, layer index, device, first byte) of every layer, attention and state, in layer order."""
    out: list[tuple[str, int, str, int]] = [(t.name, t.layer_index, t.device, t.data_ptr) for t in view.layers]
    out += [(s.name, s.layer_index, s.parts[0].device, s.parts[0].data_ptr) for s in view.states]
    return sorted(out, key=lambda x: x[1])


def storage_of_state(s: StateTensors, storage_of: dict[Any, str]) -> str:
    """The plan storage (an attention layer's allocation) the state layer lies in."""
    conv = s.parts[0]
    name = storage_of.get((conv.device, conv.storage_ptr))
    if name is None:
        raise ViewError(f"state layer '{s.name}' lies in an allocation at {conv.storage_ptr:#x} that holds no "
                        "attention layer; vLLM 0.32 puts every group in one page pool; fix: report this engine")
    return name
