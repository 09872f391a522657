"""The ``kvlc`` command line on invalid specs: exit code 2, every problem printed, no output left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvlc
from kvlc.errors import MAX_REPORTED

ROOT = Path(__file__).resolve().parents[1]
INVALID = ROOT / "tests" / "fixtures" / "invalid"
LLAMA = ROOT / "layouts" / "llama-3.1-8b.yaml"

THREE_PROBLEMS = """\
kvlc: 1
name: three
model: {name: m, num_layers: 1, num_kv_heads: 2, head_dim: 4}
block_size: 4
groups:
  - {name: full, kind: full_attention}
  - {name: full, kind: full_attention}
storages:
  - {name: kv, mem: VRAM}
layouts:
  kv:
    fields:
      - {name: k, dtype: bf16, dims: [{name: token, role: token}, {name: head, role: head}, {name: head_dim}]}
regions:
  - {name: a, storage: nowhere, layout: kv, num_blocks: 4, groups: [full]}
  - {name: b, storage: kv, layout: kv, num_blocks: 4, groups: [full], block_stride: 8}
"""

MANY_PROBLEMS = """\
kvlc: 1
name: many
model: {name: m, num_layers: 25, num_kv_heads: 2, head_dim: 4}
block_size: 4
groups: [{name: full, kind: full_attention}]
storages: [{name: kv, mem: VRAM}]
layouts:
  kv: {fields: [{name: k, dtype: bf16, dims: [{name: token, role: token}, {name: head_dim}]}]}
regions:
""" + "".join(f'  - {{name: "r.{i}", storage: "missing.{i}", layout: kv, num_blocks: 4, groups: [full]}}\n'
              for i in range(25))  # 25 places (one repeated entry would print one collapsed line)


def kvlc_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run the real command line in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "kvlc.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_check_invalid_exits_2_and_prints_problem(tmp_path):
    """`kvlc check` on an invalid spec exits 2 and prints the located problem on stderr."""
    spec = INVALID / "regions_overlap.yaml"
    out = kvlc_cli("check", spec, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    golden = (INVALID / "regions_overlap.expected").read_text().replace(
        "tests/fixtures/invalid/", f"{INVALID}/")
    assert out.stderr == golden + "kvlc: 1 of 1 spec(s) have problems\n"


def test_check_reports_each_spec(tmp_path):
    """`kvlc check GOOD BAD` reports the good one ok on stdout, the bad one on stderr, and exits 2."""
    out = kvlc_cli("check", LLAMA, INVALID / "bad_dtype.yaml", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stdout.startswith(f"{LLAMA}: ok, 32 regions, digest ")
    assert "bad_dtype.yaml:20:16: layouts.kv.fields[0].dtype: value not allowed" in out.stderr
    assert out.stderr.endswith("kvlc: 1 of 2 spec(s) have problems\n")


def test_compile_invalid_leaves_no_output(tmp_path):
    """`kvlc compile bad.yaml -o out.json` exits 2 and leaves neither out.json nor a temporary file."""
    spec = tmp_path / "bad.yaml"
    spec.write_text((INVALID / "fields_overlap.yaml").read_text())
    out = kvlc_cli("compile", spec, "-o", tmp_path / "out.json", cwd=tmp_path)
    assert out.returncode == 2
    assert "field 'v' overlaps field 'k'" in out.stderr and out.stderr.endswith("kvlc: 1 problem\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_compile_invalid_keeps_previous_output(tmp_path):
    """A failed compile does not truncate or replace a plan written by an earlier run."""
    spec, plan = tmp_path / "bad.yaml", tmp_path / "out.json"
    spec.write_text((INVALID / "unknown_storage.yaml").read_text())
    plan.write_text("previous plan\n")
    assert kvlc_cli("compile", spec, "-o", plan, cwd=tmp_path).returncode == 2
    assert plan.read_text() == "previous plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "out.json"]


def test_compile_valid_writes_exactly_the_plan(tmp_path):
    """`kvlc compile good.yaml -o out.json` writes the canonical JSON and nothing else."""
    out = kvlc_cli("compile", LLAMA, "-o", tmp_path / "out.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = kvlc.compile_spec(LLAMA)
    assert (tmp_path / "out.json").read_text() == plan.to_json() + "\n"
    assert plan.digest in out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_all_problems_are_collected(tmp_path):
    """A spec with three problems in different places reports all three, in file order."""
    spec = tmp_path / "three.yaml"
    spec.write_text(THREE_PROBLEMS)
    out = kvlc_cli("compile", spec, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert lines[-1] == "kvlc: 3 problems"
    assert [line.split(": ")[0:2] for line in lines[:-1]] == [
        [f"{spec}:7:12", "groups[1].name"],
        [f"{spec}:15:24", "regions[0].storage"],
        [f"{spec}:16:85", "regions[1].block_stride"],
    ]


def test_problems_are_capped(tmp_path):
    """More than 20 problems print the first 20 and '... and N more'; the count names them all."""
    spec = tmp_path / "many.yaml"
    spec.write_text(MANY_PROBLEMS)
    out = kvlc_cli("check", spec, cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == MAX_REPORTED + 2
    assert all("names unknown storage 'missing." in line for line in lines[:MAX_REPORTED])
    assert lines[MAX_REPORTED] == "... and 5 more"
    out = kvlc_cli("compile", spec, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.splitlines()[-1] == "kvlc: 25 problems"


def test_cli_in_process_leaves_sigpipe_alone():
    """Running the CLI in-process (CliRunner, an engine embedding it) keeps Python's SIGPIPE handling."""
    import signal

    from click.testing import CliRunner

    from kvlc.cli import main
    before = signal.getsignal(signal.SIGPIPE)
    CliRunner().invoke(main, ["compile", str(ROOT / "layouts/llama-3.1-8b.yaml"), "--text"])
    assert signal.getsignal(signal.SIGPIPE) == before


_WITHOUT_EXTRAS = """
import runpy, sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"msgpack", "torch", "nixl", "vllm", "aiohttp", "cryptography", "matplotlib"}:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in the base install)")
sys.meta_path.insert(0, _Absent())
sys.argv = ["kvlc"] + sys.argv[1:]
runpy.run_module("kvlc.cli", run_name="__main__")
"""


def test_the_main_job_needs_only_the_base_install(tmp_path):
    """README's first command on a fresh machine (`pip install -e .`, no extras): the kvlc command
    imports and compiles, explains and sizes with none of the runtime, vLLM or proxy packages."""
    for args in (["compile", str(ROOT / "layouts" / "llama-3.1-8b.yaml"), "--text"],
                 ["explain", str(ROOT / "layouts" / "llama-3.1-8b.yaml")],
                 ["size", str(ROOT / "layouts" / "llama-3.1-70b-hnd-tp4.yaml"), "--peer",
                  str(ROOT / "layouts" / "llama-3.1-70b-hnd-tp8.yaml"), "--tokens", "4096"]):
        out = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, *args], capture_output=True, text=True,
                             cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, (args[0], out.stderr[-1500:])
