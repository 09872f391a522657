"""From one layer tensor's element geometry to kvlc block geometry.

A layer tensor is a strided array whose dims have meanings (:class:`Axis`). The
``block`` dim gives the region's block count and stride; the dims inside a block
become one kvlc field whose dims are ordered by stride (outermost first), which
kvlc lays out row-major — so they must be dense. A packed ``content`` dim is
first split into ``kv`` and ``head_dim`` as the backend reads it
(:class:`KvPacking`). A ``kv`` dim that lies outside the block (K blocks of all
blocks, then V blocks) splits the layer into two regions, ``k`` and ``v``.

>>> from kvlc.engines.vllm.derive.view import EngineView, EXAMPLE
>>> view = EngineView.from_dict(EXAMPLE)
>>> g = layer_geometry(view.layers[0], view)
>>> [d.axis.value for d in g.dims], g.block_stride, g.parts
(['head', 'kv', 'cell'], 16384, (Part(suffix='', field='kv', offset=0),))
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlc.engines.vllm.derive.view import Axis, EngineView, KvPacking, LayerTensor, ViewError


@dataclass(frozen=True)
class Dim:
    """A dim in elements: what it means, how many, how far apart."""

    axis: Axis
    size: int
    stride: int


@dataclass(frozen=True)
class Part:
    """One region of a layer: name suffix ('' or '.k'/'.v'), field name, byte offset from the tensor."""

    suffix: str
    field: str
    offset: int


@dataclass(frozen=True)
class LayerGeometry:
    """A layer's kvlc geometry: blocks, their byte stride, the field's dims (outermost first), parts."""

    num_blocks: int
    block_stride: int
    dims: tuple[Dim, ...]
    parts: tuple[Part, ...]

    @property
    def code(self) -> str:
        """A short name for the dim order: h=head, n=token, 2=kv, d=head_dim, l=latent, c=cell."""
        letters = {Axis.HEAD: "h", Axis.TOKEN: "n", Axis.KV: "2", Axis.HEAD_DIM: "d", Axis.LATENT: "l",
                   Axis.CELL: "c"}
        return "".join(letters[d.axis] for d in self.dims)


def _dims(t: LayerTensor) -> list[Dim]:
    if not (len(t.axes) == len(t.shape) == len(t.strides)):
        raise ViewError(f"tensor '{t.name}': axes {tuple(a.value for a in t.axes)}, shape {t.shape} and "
                        f"strides {t.strides} must have one entry per dim")
    return [Dim(a, s, st) for a, s, st in zip(t.axes, t.shape, t.strides)]


def _find(dims: list[Dim], axis: Axis, t: LayerTensor) -> int:
    hits = [i for i, d in enumerate(dims) if d.axis == axis]
    if len(hits) != 1:
        raise ViewError(f"tensor '{t.name}': expected one '{axis.value}' dim, found {len(hits)} "
                        f"(axes {tuple(a.value for a in t.axes)})")
    return hits[0]


def _unpack_content(dims: list[Dim], t: LayerTensor, view: EngineView) -> list[Dim]:
    """Replace a packed K|V ``content`` dim by ``kv`` and ``head_dim`` (and re-tile the token dim)."""
    if not any(d.axis == Axis.CONTENT for d in dims):
        return dims
    c = _find(dims, Axis.CONTENT, t)
    cd = dims[c]
    head_dim = view.model.head_dim
    if cd.size != 2 * head_dim:
        raise ViewError(f"tensor '{t.name}': the K|V content dim has {cd.size} elements; expected "
                        f"2 x head_dim = {2 * head_dim}")
    if view.kv_packing == KvPacking.PER_TOKEN:
        return dims[:c] + [Dim(Axis.KV, 2, head_dim * cd.stride), Dim(Axis.HEAD_DIM, head_dim, cd.stride)] \
            + dims[c + 1:]
    if view.kv_packing != KvPacking.PER_HEAD_BLOCK:
        raise ViewError(f"tensor '{t.name}' has a packed K|V content dim but the view says kv_packing "
                        f"'{view.kv_packing.value}'; expected 'per_token' or 'per_head_block'")
    n = _find(dims, Axis.TOKEN, t)
    nd = dims[n]
    if nd.stride != cd.size * cd.stride or n + 1 != c:
        raise ViewError(f"tensor '{t.name}': {view.backend} re-views each head's [token][2*head_dim] rows "
                        f"as [2*token][head_dim], which needs them dense: token stride {nd.stride}, "
                        f"expected {cd.size * cd.stride} (content size x stride) right before the content dim")
    # Each half is N * D elements in an order of the kernel ISA's (K is stored transposed with
    # the vec ISA), not the view's: kvlc's spec language cannot give K and V different dim
    # orders, so the half is one opaque 'cell' dim — exact bytes, tokens not addressable.
    inner = [Dim(Axis.KV, 2, nd.size * head_dim * cd.stride), Dim(Axis.CELL, nd.size * head_dim, cd.stride)]
    return dims[:n] + inner + dims[c + 1:]


def _check_dense(inner: list[Dim], t: LayerTensor, block_stride: int) -> None:
    """kvlc fields are row-major: each dim's stride is the product of the sizes inside it."""
    expect = 1
    for d in reversed(inner):
        if d.size > 1 and d.stride != expect:
            order = ", ".join(f"{x.axis.value}={x.size}:{x.stride}" for x in inner)
            raise ViewError(f"tensor '{t.name}': dim '{d.axis.value}' has element stride {d.stride}, expected "
                            f"{expect} for a dense block (dims by stride: {order}; block stride {block_stride}); "
                            "kvlc needs each block's dims dense — use a block-compact KV-cache layout "
                            "(LBHNC, LBNHC, BLHNC or BLNHC)")
        expect *= d.size
    if expect > block_stride:
        raise ViewError(f"tensor '{t.name}': a block holds {expect} elements but blocks are {block_stride} "
                        "elements apart, so blocks overlap")


def layer_geometry(t: LayerTensor, view: EngineView) -> LayerGeometry:
    """The kvlc geometry of layer tensor ``t`` (see the module docstring)."""
    dims = _unpack_content(_dims(t), t, view)
    b = dims.pop(_find(dims, Axis.BLOCK, t))
    parts = (Part("", "latent" if any(d.axis == Axis.LATENT for d in dims) else "kv", 0),)
    if any(d.axis == Axis.LATENT for d in dims):
        dims = [d for d in dims if not (d.axis == Axis.HEAD and d.size == 1)]  # MLA: one latent per token
    kv = next((i for i, d in enumerate(dims) if d.axis == Axis.KV), None)
    if kv is not None and dims[kv].stride > b.stride:  # K of every block, then V: two regions
        step = dims.pop(kv).stride * t.itemsize
        parts = (Part(".k", "k", 0), Part(".v", "v", step))
    # outermost first; a size-1 dim that ties with a larger one lies inside it (its stride is the extent below)
    inner = sorted(dims, key=lambda d: (-d.stride, d.size == 1))
    _check_dense(inner, t, b.stride)
    return LayerGeometry(num_blocks=b.size, block_stride=b.stride * t.itemsize, dims=tuple(inner), parts=parts)
