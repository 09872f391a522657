"""Architecture contracts: the compiler stays pure and the CLI's compile path needs no runtime."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'nixl', 'nixl_cu12', 'nixl_cu13'):
            raise ImportError(f'{name} is not allowed here')
        return None
sys.meta_path.insert(0, Block())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_compiler_and_pairing_run_without_torch_or_nixl():
    """load, compile, pair and instantiate work with torch and nixl unimportable."""
    out = _run("import kvlc, numpy as np\n"
               "a = kvlc.compile_spec('layouts/llama-3.1-70b-tp8.yaml')\n"
               "b = kvlc.compile_spec('layouts/llama-3.1-70b-tp4.yaml')\n"
               "prog = kvlc.pair(b, a, local_rank=0, direction='READ')\n"
               "lb = {s.name: 1 << 40 for s in b.storages}\n"
               "rb = {r: {s.name: 2 << 40 for s in a.storages} for r in prog.peer_ranks}\n"
               "parts = kvlc.instantiate(kvlc.bind(prog, lb, rb), {'full': [1, 2]}, {'full': [3, 4]}, 20)\n"
               "print(sum(len(p) for p in parts.values()))\n")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


def test_cli_compile_runs_without_torch_or_nixl():
    """`kvlc compile` and `kvlc explain` need only the compiler's dependencies."""
    out = _run("import sys\nfrom kvlc.cli import main\n"
               "sys.argv = ['kvlc', 'compile', 'layouts/deepseek-v3-tp8.yaml', '--text']\n"
               "main()\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("plan deepseek-v3-tp8")


def test_compiler_sources_import_no_runtime():
    """No module under kvlc/compiler names torch, nixl or kvlc.runtime in an import."""
    for path in (ROOT / "kvlc" / "compiler").rglob("*.py"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import ", "from ")):
                assert not any(m in stripped for m in ("torch", "nixl", "kvlc.runtime")), f"{path.name}: {line}"


def test_compiler_pipeline_is_ordered_data():
    """PASSES, check.CHECKS and compat.CHECKS are ordered tuples of functions, each with a docstring."""
    import importlib

    from kvlc.compiler import PASSES
    from kvlc.compiler.pairing import compat
    check = importlib.import_module("kvlc.compiler.plan.check")

    assert [f.__name__ for f in PASSES] == ["expand", "resolve", "check", "build_plan"]
    for table in (PASSES, check.CHECKS, compat.CHECKS, compat.REGION_CHECKS, compat.FIELD_CHECKS):
        assert isinstance(table, tuple) and all(callable(f) and f.__doc__ for f in table)


def test_package_holds_no_issue_numbers_or_benchmark_reports():
    """Nothing under kvlc/ names an issue number; benchmark reporting lives in benchmarks/."""
    import re

    assert not (ROOT / "kvlc" / "bench.py").exists()
    for path in (ROOT / "kvlc").rglob("*.py"):
        assert not re.search(r"\bissues? #?\d", path.read_text(), re.I), path
