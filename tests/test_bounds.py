"""No plan reaches past 2**63 bytes: derived region ends and storage sizes are bounded, addresses never wrap."""

from __future__ import annotations

import pytest

import kvlc
from kvlc.errors import SpecError

SPEC = """
kvlc: 1
name: huge
model: {{name: m, num_layers: 1, num_kv_heads: 4, head_dim: 128}}
block_size: 16
groups: [{{name: full, kind: full_attention}}]
storages: [{{name: kv, mem: VRAM}}]
layouts:
  kv:
    fields:
      - {{name: k, dtype: bf16, dims: [{{name: token, role: token}}, {{name: head, role: head}}, {{name: head_dim}}]}}
regions:
  - {{name: layer.0, storage: kv, layout: kv, num_blocks: {blocks}, block_stride: {stride}, groups: [full]}}
"""


@pytest.mark.parametrize("blocks, stride", [((1 << 49) + 1, "auto"), (1 << 50, "auto"), (2, 1 << 63), (1 << 70, "auto")])
def test_regions_past_2_63_bytes_are_refused(blocks, stride):
    """A region whose blocks end past 2**63 bytes (so its storage would too) is refused at num_blocks/stride."""
    with pytest.raises(SpecError) as info:
        kvlc.compile_spec(SPEC.format(blocks=blocks, stride=stride))
    assert any(p.path[:2] == ("regions", 0) and p.path[-1] in ("num_blocks", "block_stride")
               for p in info.value.problems), info.value.render()


def test_largest_fitting_region_compiles():
    """Just below the bound (the most blocks a spec may take, 2**40, 4 MiB apart = 2**62 bytes) compiles exactly."""
    plan = kvlc.compile_spec(SPEC.format(blocks=1 << 40, stride=1 << 22))
    r = plan.regions[0]
    assert r.block_bytes == 16 * 4 * 128 * 2 and r.block_stride == 1 << 22
    assert plan.storage("kv").size == (1 << 40) * (1 << 22) < 1 << 63
