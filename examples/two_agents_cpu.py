"""Two kvlc agents on one CPU: a pull and a push between DRAM pools over NIXL (UCX loopback), bytes checked.

    python3 examples/two_agents_cpu.py        # prints one line per request; exit 0 when every byte matched

A prefill agent and a decode agent (one process, each its own NIXL agent and authenticated side
channel) share one plan: 2 layers, K and V head-major, 16 tokens per block, 64 blocks per layer.
The decode agent pulls prefill blocks 5, 6 into its blocks 0, 1 (READ); then the prefill agent
pushes its blocks 9, 10, 11 into decode blocks 20, 21, 22 (WRITE, the decode side `expect`s it).
After each request every storage's destination blocks are compared with the source blocks.
Needs nixl (UCX backend) and torch.
"""

from __future__ import annotations

import sys

import torch

import kvlc
from kvlc.runtime import AgentSettings, KvAgent, allocate

SPEC = """
kvlc: 1
name: two-agents-cpu
model: {name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 64}
block_size: 16
groups: [{name: full, kind: full_attention}]
storages:
  - repeat: {var: layer, range: layers}
    storages: [{name: "kv.{layer}", mem: DRAM}]
layouts:
  kv:
    fields:
      - {name: k, dtype: bf16, dims: [{name: head, role: head}, {name: token, role: token}, {name: head_dim}]}
      - {name: v, dtype: bf16, dims: [{name: head, role: head}, {name: token, role: token}, {name: head_dim}]}
regions:
  - repeat: {var: layer, range: layers}
    regions: [{name: "layer.{layer}", storage: "kv.{layer}", layout: kv, num_blocks: 64, groups: [full]}]
"""
SECRET = "example secret shared by both engines"  # in a deployment: $KVLC_SECRET or $KVLC_SECRET_FILE


def same_blocks(plan, dst: dict, dst_ids: list[int], src: dict, src_ids: list[int]) -> bool:
    """Every storage's destination blocks hold exactly the source blocks' bytes."""
    stride = plan.regions[0].block_stride
    return all(torch.equal(dst[name][d * stride:(d + 1) * stride], src[name][s * stride:(s + 1) * stride])
               for name in dst for d, s in zip(dst_ids, src_ids))


def main() -> int:
    plan = kvlc.compile_spec(SPEC)
    prefill_tensors, decode_tensors = allocate(plan), allocate(plan)  # one uint8 tensor per storage
    for t in prefill_tensors.values():
        t.random_(0, 256)
    ok = True
    with KvAgent(plan, 0, prefill_tensors, AgentSettings(engine_id="prefill", secret=SECRET)) as prefill, \
         KvAgent(plan, 0, decode_tensors, AgentSettings(engine_id="decode", secret=SECRET)) as decode:
        # pull: the decode engine connects to the prefill engine's side channel and READs
        peer = decode.connect(prefill.serve("127.0.0.1"), direction="READ")
        peer.read("pull-1", {"full": [0, 1]}, {"full": [5, 6]}, num_tokens=32)
        done = decode.wait(["pull-1"], timeout=60)
        good = done.finished == ("pull-1",) and same_blocks(
            plan, decode_tensors, [0, 1], prefill_tensors, [5, 6])
        print(f"pull-1: 32 tokens, prefill blocks 5,6 -> decode blocks 0,1: {'ok' if good else 'MISMATCH'}")
        ok &= good

        # push: the prefill engine connects to the decode engine and WRITEs; the decode side expects it
        pusher = prefill.connect(decode.serve("127.0.0.1"), direction="WRITE")
        decode.expect("push-1", timeout=60)
        pusher.write("push-1", {"full": [9, 10, 11]}, {"full": [20, 21, 22]}, num_tokens=48)
        done = decode.wait(["push-1"], timeout=60)
        good = done.finished == ("push-1",) and same_blocks(
            plan, decode_tensors, [20, 21, 22], prefill_tensors, [9, 10, 11])
        print(f"push-1: 48 tokens, prefill blocks 9,10,11 -> decode blocks 20,21,22: "
              f"{'ok' if good else 'MISMATCH'}")
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
