"""The spec language described for people and editors: one text per model field.

:data:`FIELD_DOCS` holds what every field of every model in :mod:`kvlc.compiler.spec.models` means.
Two things are made from it and the models themselves:

* :func:`schema` — pydantic's JSON Schema of :class:`~kvlc.compiler.spec.models.LayoutSpec` with these
  texts as ``description``s (``kvlc schema``; editors show them on hover);
* :func:`reference_tables` — the per-model tables of ``docs/spec.md`` (a test keeps the page
  equal to them, and fails for a field without a text).
"""

from __future__ import annotations

import json
import typing
from typing import Iterator

from pydantic import BaseModel

from kvlc.compiler.spec.models import LayoutSpec

SCHEMA_ID = "https://kvlc.dev/schema/spec-v1.json"

# (model, field) -> meaning. Written for a user: units, defaults and what kvlc derives.
FIELD_DOCS: dict[tuple[str, str], str] = {
    ("LayoutSpec", "kvlc"): "Language version; always `1`.",
    ("LayoutSpec", "name"): "The engine layout's name (plans, handshakes and reports show it).",
    ("LayoutSpec", "model"): "What model the cache belongs to; pairing compares it.",
    ("LayoutSpec", "parallel"): "Tensor / decode-context / pipeline parallelism of the engine.",
    ("LayoutSpec", "block_size"): "Tokens per logical block: what one block id of the engine addresses.",
    ("LayoutSpec", "kernel_block_size"): "Tokens per kernel block (the attention kernel's block), a divisor of "
                                          "`block_size`; a logical block is `block_size / kernel_block_size` "
                                          "consecutive kernel blocks. Default: `block_size`.",
    ("LayoutSpec", "groups"): "The KV-cache groups (at least one). A block id belongs to one group.",
    ("LayoutSpec", "storages"): "Allocations (one tensor each), or `repeat` entries stamping several.",
    ("LayoutSpec", "layouts"): "Block layouts by name: the struct of one kernel block.",
    ("LayoutSpec", "regions"): "Runs of equal blocks inside storages, or `repeat` entries stamping several.",
    ("ModelInfo", "name"): "Model id, e.g. `meta-llama/Llama-3.1-8B`; both engines of a pair must agree.",
    ("ModelInfo", "num_layers"): "Layers of the whole model; `range: layers` counts them (or `parallel.layers`).",
    ("ModelInfo", "num_kv_heads"): "Global KV heads: the size of every dim named `head` that gives none.",
    ("ModelInfo", "head_dim"): "The size of every dim named `head_dim` that gives none.",
    ("ModelInfo", "sizes"): "More named sizes: a dim of that name takes (and must match) it; "
                            "`size: NAME` refers to one.",
    ("Parallel", "tp_size"): "Tensor-parallel ranks. A `role: head` dim holds `size / tp_size` heads per rank "
                             "(one replica per rank when tp_size is a multiple of the size). Default 1.",
    ("Parallel", "pcp_size"): "Prefill-context-parallel ranks (vLLM `prefill_context_parallel_size`): adds ranks "
                              "(the engine has `tp_size * pcp_size`, rank = pcp_rank * tp_size + tp_rank) that "
                              "split prefill compute; without DCP each keeps a whole replica of its heads' KV. "
                              "Default 1.",
    ("Parallel", "dcp_size"): "Decode-context-parallel ranks (vLLM `decode_context_parallel_size`): tokens of a "
                              "request are interleaved over `dcp_size` ranks, so one block id covers "
                              "`block_size * dcp_size` tokens. Without PCP it divides `tp_size` (consecutive TP "
                              "ranks); with PCP it is 1, `pcp_size` or `tp_size * pcp_size`. Default 1.",
    ("Parallel", "dcp_interleave"): "Tokens a DCP rank stores in a row before the next rank's turn (vLLM "
                                    "`cp_kv_cache_interleave_size`): token t is on DCP rank "
                                    "`(t // dcp_interleave) % dcp_size`. Divides every kernel block size; "
                                    "needs `dcp_size > 1`. Default 1.",
    ("Parallel", "layers"): "`[start, stop)` layers of this pipeline stage; default all of `model.num_layers`.",
    ("_GroupBase", "name"): "The group's name; regions list it under `groups`, requests key block ids by it.",
    ("FullAttention", "kind"): "`full_attention`: K/V (or a latent) of every token.",
    ("SlidingWindow", "kind"): "`sliding_window`: K/V of a sliding-window attention layer.",
    ("ChunkedLocal", "kind"): "`chunked_local`: K/V of chunked local attention.",
    ("Indexer", "kind"): "`indexer`: a sparse-attention indexer's keys and scales.",
    ("MambaState", "kind"): "`mamba`: per-request state; a block is one request's Mamba state, no token dim.",
    ("LinearAttention", "kind"): "`linear_attention`: per-request state of a linear-attention layer.",
    ("_GroupBase", "block_size"): "This group's tokens per logical block; default the spec's `block_size`.",
    ("_GroupBase", "kernel_block_size"): "This group's tokens per kernel block; default the group's block size "
                                          "if it sets one, else the spec's `kernel_block_size`.",
    ("_GroupBase", "dcp"): "`sharded` (default) or `replicated`: under decode context parallelism "
                           "(`dcp_size` > 1), a `replicated` group is not token-sharded: every rank "
                           "holds all of its tokens and one block id covers `block_size` tokens, not "
                           "`block_size * dcp_size` (a draft/MTP cache vLLM keeps whole under DCP). "
                           "Default `sharded`.",
    ("_GroupBase", "tokens_per_entry"): "Tokens one entry of the `token` dims covers: 1, or k for a compressed "
                                         "cache (one entry per k tokens). Block sizes stay in tokens and must be "
                                         "multiples of k; N tokens are `ceil(N / k)` entries. Default 1.",
    ("SlidingWindow", "window"): "Tokens of the attention window.",
    ("ChunkedLocal", "chunk"): "Tokens of an attention chunk.",
    ("Storage", "name"): "The name the runtime binds a tensor to (`tensors={name: tensor}`); "
                         "`{var}` is replaced inside a repeat.",
    ("Storage", "mem"): "`DRAM` (host memory: a CPU tensor, pinned for speed) or `VRAM` (a `cuda:DEVICE` tensor).",
    ("Storage", "device"): "GPU index for VRAM (the tensor must be on `cuda:DEVICE`); 0 for DRAM. Default 0.",
    ("Storage", "size"): "Bytes of the tensor; checked against the regions. Default: exactly what the regions "
                         "need (the last region's end, at full stride).",
    ("Storage", "align"): "Byte alignment of the auto-placed (`offset: auto`) regions in it. Default 1.",
    ("Dim", "name"): "The dim's name; the same name on both engines is the same axis of content.",
    ("Dim", "size"): "An integer, a `model.sizes` name, or omitted: a dim named like a model size takes it; "
                     "a `token` dim takes the kernel block size (in entries: divided by the group's "
                     "`tokens_per_entry`). A `head` dim gives the *global* count.",
    ("Dim", "role"): "`token` (the axis block size counts), `head` (sharded by tensor parallelism), or none.",
    ("Dim", "stride"): "Byte stride of this dim (CuTe-style `shape:stride`); on every dim of a field or on "
                       "none. With strides, fields of different dtypes interleave in one per-token record "
                       "(checked byte-exactly for overlap); without, dims are row-major over per-rank sizes.",
    ("Dim", "sections"): "Only in a `kind: sections` field: `{NAME: SIZE, ...}` splits this dim into named "
                         "parts, each sharded by TP on its own (Mamba conv x|B|C), unless the field's "
                         "`replicated` names it.",
    ("ArrayField", "kind"): "`array` (the default; may be omitted).",
    ("ArrayField", "name"): "The field's name (`k`, `v`, `latent`, ...); matched by name across engines.",
    ("ArrayField", "dtype"): "Element type: `bf16 fp16 fp32 fp8_e4m3 fp8_e5m2 ue8m0 int8 uint8 fp4_e2m1` "
                             "(`fp4_e2m1`: two values per byte along the innermost dim, which must be a "
                             "plain dim of even size).",
    ("ArrayField", "offset"): "Byte offset in the block; default right after the previous field.",
    ("ArrayField", "dims"): "Dims outermost first; strides are row-major over the per-rank sizes.",
    ("SectionsField", "kind"): "`sections`: one dim is split into named sections, each its own field "
                               "`NAME.SECTION`.",
    ("SectionsField", "name"): "The field's name; its sections become fields `NAME.SECTION`.",
    ("SectionsField", "dtype"): "Element type, as for an array field.",
    ("SectionsField", "offset"): "Byte offset in the block; default right after the previous field.",
    ("SectionsField", "dims"): "Dims outermost first; exactly one carries `sections`.",
    ("SectionsField", "replicated"): "Sections of the split (`head`) dim that every TP rank holds whole "
                                     "instead of a slice: vLLM's Mamba-2 `B` and `C` when the model has one "
                                     "group (`n_groups: 1`).",
    ("BlockLayout", "fields"): "The fields of one kernel block, in order.",
    ("BlockLayout", "size"): "Bytes of one block (padding after the fields); default the end of the last field.",
    ("Region", "kind"): "`region` (implied; may be omitted).",
    ("Region", "name"): "The region's name: regions of two engines correspond by name (`layer.{layer}`).",
    ("Region", "storage"): "The storage it lives in.",
    ("Region", "layout"): "The block layout of its blocks (a key of `layouts`).",
    ("Region", "num_blocks"): "Kernel blocks it holds; block ids address logical blocks "
                              "(`num_blocks / (block_size / kernel_block_size)` of them).",
    ("Region", "aliases"): "Regions this one lies over page for page (same storage, offset, stride and "
                          "block count), serving other groups of one page pool (vLLM's hybrid allocator); "
                          "any overlap not declared here is an error.",
    ("Region", "part_of"): "The region whose fields this one holds part of, when one region's fields live in "
                           "several runs of blocks (vLLM's split K/V: `layer.{layer}.k` and `layer.{layer}.v`, "
                           "both `part_of: layer.{layer}`). Pairing matches fields by the region they are part "
                           "of and their name, so split and joint tensors pair. Default: none (the region "
                           "itself).",
    ("Region", "groups"): "The group(s) whose blocks it holds; several = a region shared by groups of one "
                          "block geometry.",
    ("Region", "offset"): "Byte offset of block 0 in the storage, or `auto`: after the previous region in "
                          "that storage, aligned to the storage's `align`. Default `auto`.",
    ("Region", "block_stride"): "Bytes from one block's start to the next (>= the block's bytes), or `auto` "
                                "(packed). Interleaved regions use a larger stride and offsets inside it.",
    ("Region", "optional"): "May be absent on the peer (e.g. a draft model's layer); pairing skips it. "
                            "Default false.",
    ("Range", "var"): "The variable `{var}` that names use inside the repeat.",
    ("Range", "range"): "`layers` (the engine's layers: `parallel.layers` or all), `[start, stop]` or "
                        "`[start, stop, step]` (stop excluded).",
    ("Range", "values"): "An explicit list of distinct values, instead of `range`.",
    ("RepeatRegions", "kind"): "`repeat` (implied by the `repeat:` key; may be omitted).",
    ("RepeatRegions", "repeat"): "The values to stamp the entries with.",
    ("RepeatRegions", "regions"): "Regions (or nested repeats) stamped once per value.",
    ("RepeatStorages", "kind"): "`repeat` (implied by the `repeat:` key; may be omitted).",
    ("RepeatStorages", "repeat"): "The values to stamp the entries with.",
    ("RepeatStorages", "storages"): "Storages (or nested repeats) stamped once per value.",
}


def models() -> tuple[type[BaseModel], ...]:
    """Every pydantic model a spec is made of, reached from :class:`LayoutSpec`, in first-seen order.

    >>> [m.__name__ for m in models()][:3]
    ['LayoutSpec', 'ModelInfo', 'Parallel']
    """
    seen: dict[type, None] = {}

    def walk(tp) -> Iterator[type]:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            yield tp
            return
        for arg in typing.get_args(tp):
            yield from walk(arg)

    todo = [LayoutSpec]
    while todo:
        m = todo.pop(0)
        if m in seen:
            continue
        seen[m] = None
        for f in m.model_fields.values():
            todo.extend(x for x in walk(f.annotation) if x not in seen)
    return tuple(seen)


def field_doc(model: type[BaseModel], field: str) -> str | None:
    """The text of ``model.field``, looked up along the model's bases (groups share ``_GroupBase``)."""
    for base in model.__mro__:
        text = FIELD_DOCS.get((base.__name__, field))
        if text is not None:
            return text
    return None


def schema() -> dict:
    """The JSON Schema of a spec (pydantic's), with every field's text as its ``description``.

    >>> s = schema()
    >>> s["title"], s["properties"]["block_size"]["description"][:15]
    ('LayoutSpec', 'Tokens per logi')
    """
    out = LayoutSpec.model_json_schema()      # draft 2020-12, as pydantic writes it; no "$schema" key, so
    out["$id"] = SCHEMA_ID                    # editors that know only older drafts read it too
    defs = out.get("$defs", {})
    for m in models():
        node = out if m is LayoutSpec else defs.get(m.__name__)
        if node is None:
            continue
        if m.__doc__:
            node["description"] = " ".join(m.__doc__.split())
        for name, prop in node.get("properties", {}).items():
            text = field_doc(m, name)
            if text:
                prop["description"] = text
    return out


def schema_json() -> str:
    """:func:`schema` as indented JSON text with a final newline (what ``kvlc schema`` prints)."""
    return json.dumps(schema(), indent=2) + "\n"


def _type_text(annotation) -> str:
    text = str(annotation).replace("typing.", "").replace("kvlc.compiler.spec.models.", "")
    for noise in ("Annotated[", "NoneType"):
        text = text.replace(noise, "None" if noise == "NoneType" else "")
    return text


def reference_tables() -> str:
    """Markdown: one table per model (field, type, default, meaning), in :func:`models` order."""
    lines = []
    for m in models():
        lines += [f"### `{m.__name__}`", ""]
        if m.__doc__:
            lines += [" ".join(m.__doc__.split()), ""]
        lines += ["| field | required | default | meaning |", "|---|---|---|---|"]
        for name, f in m.model_fields.items():
            required = "yes" if f.is_required() else ""
            default = "" if f.is_required() else _default_text(f)
            text = (field_doc(m, name) or "").replace("|", "\\|")
            lines.append(f"| `{name}` | {required} | {default} | {text} |")
        lines.append("")
    return "\n".join(lines)


def _default_text(f) -> str:
    if f.default_factory is not None:
        value = f.default_factory()
        if hasattr(value, "__len__") and len(value) == 0:
            return "`{}`" if hasattr(value, "keys") else "`[]`"
        return "(computed)"
    d = f.default
    if isinstance(d, BaseModel):
        return "defaults"
    if d is None:
        return "none"
    if isinstance(d, bool):
        return f"`{str(d).lower()}`"
    return f"`{d}`"
