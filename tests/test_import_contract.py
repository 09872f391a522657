"""The import contract: kvlc's layers and its acyclic file graph, checked over the real import graph.

The contracts are stated once, in pyproject.toml's ``[tool.importlinter]``, and checked by
import-linter (``lint-imports``), which reads every import statement of every file under kvlc/,
those inside functions included. The negative controls copy the package, add one forbidden import
and check that the contract names it: a contract that cannot fail proves nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "kvlc", tree / "kvlc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _add_line(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_every_import_contract_is_kept():
    """Layers (cli > init > demo|engines > runtime|explain > compiler > errors), the compiler's stages in
    pipeline order, the runtime's core over staging over channel over NIXL, the compiler's purity and
    zero import cycles between files all hold for the tree as it is."""
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout, out.stdout[-3000:]


def test_contract_names_a_stage_importing_a_later_stage(tmp_path):
    """Negative control: a plan pass that imports the pairing stage breaks the stage layers, named by file."""
    tree = _copy(tmp_path)
    _add_line(tree / "kvlc/compiler/plan/build.py", "import kvlc.compiler.pairing.compat  # the control")
    out = _lint(tree)
    assert out.returncode != 0
    assert "kvlc.compiler.plan.build -> kvlc.compiler.pairing.compat" in out.stdout, out.stdout[-3000:]


def test_contract_sees_a_cycle_hidden_inside_a_function(tmp_path):
    """Negative control: an import inside a function that closes a cycle between two files is found."""
    tree = _copy(tmp_path)
    # plan/build.py imports plan/model.py; the reverse import, hidden in a function, closes a cycle.
    _add_line(tree / "kvlc/compiler/plan/model.py",
              "def _control():\n    from kvlc.compiler.plan import build  # the control\n    return build")
    out = _lint(tree)
    assert out.returncode != 0
    assert "No cycles are allowed in kvlc.compiler.plan" in out.stdout, out.stdout[-3000:]


def test_contract_keeps_torch_out_of_the_compiler(tmp_path):
    """Negative control: the compiler importing torch (even lazily) breaks the purity contract."""
    tree = _copy(tmp_path)
    _add_line(tree / "kvlc/compiler/request/rows.py", "def _control():\n    import torch  # the control\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert "kvlc.compiler.request.rows -> torch" in out.stdout, out.stdout[-3000:]
