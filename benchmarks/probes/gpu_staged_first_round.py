"""GPU: the first round of staged pushes against later ones (fragmented VRAM and mixed DRAM/VRAM TP1).

Two KvAgent processes on cuda:0, default staging geometry, automatic gate: Llama-3.1-8B push of 16
requests of 256 MiB with random block ids (4,084 descriptors of 64 KiB, 4 in flight per round),
then DeepSeek-V3.2 -> HiSparse at TP1 (see benchmarks/probes/gpu_staging_depth.py), 8 requests. Prints one
JSON row per case with every round's seconds, the first round's GB/s and the later rounds'.
Used to A/B a change meant to shorten the first round (run from two trees, alternated: benchmarks/README.md).

Run (from the repository root):  python3 benchmarks/probes/gpu_staged_first_round.py [gpu|cpu] [OUT.json]
"""

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, the suite
sys.path.insert(0, str(Path(__file__).resolve().parent))  # probes/


def main():
    from gpu_staging_depth import agent_row, tp1
    from gpu_transfer import DSV32, LLAMA, on_device

    dev = sys.argv[1] if len(sys.argv) > 1 else "gpu"
    scale = 1 if dev == "gpu" else 16
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        llama = on_device(LLAMA, 0, t) if dev == "gpu" else LLAMA
        dp, dc = (tp1(str(ROOT / x), t) for x in DSV32)
        if dev == "gpu":
            dp, dc = on_device(dp, 0, t), on_device(dc, 0, t)
        env = {"KVLC_STAGING": "auto" if dev == "gpu" else "always"}
        rows.append(agent_row("kvlc staged VRAM llama-3.1-8b push random ids [default]", env, layout=llama,
                              consumer_layout=llama, mode="push", requests=16, tokens=2048 // scale,
                              max_bytes=(1 << 30) // scale, device=dev, ids="random"))
        rows.append(agent_row("kvlc staged mixed deepseek-v3.2 -> hisparse TP1 push [default]", env, layout=dp,
                              consumer_layout=dc, mode="push", requests=8, tokens=4096 // scale,
                              max_bytes=(1 << 30) // scale, device=dev, ids="contiguous"))
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
