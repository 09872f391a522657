"""What a lent GPU host needs next to the working tree, made on this machine (the host has no package index).

A device call copies the repository's tracked files plus the git-ignored paths it is told to carry, 64 MiB in
all. This script fills the two ignored folders the GPU commands in benchmarks/README.md use:

* ``.whl/``: Python 3.12 manylinux wheels of NIXL (``nixl`` and ``nixl-cu13``, the version installed here) and
  of what kvlc's runtime imports (pydantic and its parts, pydantic-settings, cryptography and cffi), each
  without its dependencies. ``nixl-cu13`` is repacked without its ``nixl_ep_cu13`` part (expert-parallel
  kernels, ~95 MiB, which kvlc does not use): the whole wheel does not fit the carry.
* ``.carry/<name>.tgz``: a tree of kvlc at a git revision (the package, benchmarks' scripts, testkit, layouts),
  with its C libraries built from that revision's sources (``setup.py build_ext`` in a temporary worktree;
  stable ABI, so they load on the host's CPython 3.12). Trees at two revisions side by side give the
  old / new comparisons run in one call.
* ``.carry/setup.sh``: run first on the host: installs the wheels into ``/tmp/site`` and unpacks every tree
  to ``/tmp/trees/<name>``; then ``PYTHONPATH=/tmp/trees/<name>:/tmp/site`` runs that tree.

It ends by printing what the carry adds up to, against the limit.

Run:  python3 benchmarks/device_carry.py --wheels --tree new=HEAD --tree old=58edb9b
then: run(command="bash .carry/setup.sh && cd /tmp/trees/new && PYTHONPATH=$PWD:/tmp/site \\
          python3 benchmarks/gpu_suite.py --out $OUT/suite.json", carry=[".whl", ".carry"])
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 << 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
RUNTIME = ("pydantic", "pydantic-core", "typing-extensions", "annotated-types", "typing-inspection",
           "pydantic-settings", "python-dotenv", "cryptography", "cffi", "pycparser")
TREE = ("kvlc", "benchmarks", "testkit", "layouts", "pyproject.toml", "setup.py")
DROPPED = "nixl_ep_cu13/"  # the part of nixl-cu13 left out

SETUP = """#!/usr/bin/env bash
# made by benchmarks/device_carry.py: the wheels into /tmp/site, every tree to /tmp/trees/<name>
set -e
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
for t in .carry/*.tgz; do
    name=$(basename "$t" .tgz)
    mkdir -p /tmp/trees/$name && tar -C /tmp/trees/$name -xzf "$t"
done
echo "trees: $(ls /tmp/trees)"
"""


def _pinned(name: str) -> str:
    """``name==<version installed here>`` (a GPU host runs what this machine's tests ran)."""
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def wheels(folder: Path) -> None:
    """Download the wheels for CPython 3.12 on x86-64 Linux into ``folder`` (emptied first)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    nixl = importlib.metadata.version("nixl")
    wanted = [f"nixl=={nixl}", f"nixl-cu13=={nixl}", *(_pinned(n) for n in RUNTIME)]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", *platforms, "-d", str(folder), *wanted], check=True)
    for whl in folder.glob("nixl_cu13-*.whl"):
        _drop_part(whl, DROPPED)


def _drop_part(whl: Path, prefix: str) -> None:
    """Rewrite wheel ``whl`` without the files under ``prefix`` (and their lines in its RECORD)."""
    out = whl.with_suffix(".tmp")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for item in src.infolist():
            if item.filename.startswith(prefix):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not line.startswith(prefix.encode()))
            dst.writestr(item, data)
    out.replace(whl)


def tree(name: str, rev: str, folder: Path) -> Path:
    """``folder/<name>.tgz``: kvlc at ``rev`` with its C libraries built from that revision's sources."""
    tar = folder / f"{name}.tgz"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "tree"
        made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(work), rev],
                              capture_output=True, text=True)
        if made.returncode:
            raise SystemExit(f"--tree {name}={rev}: git cannot check out {rev!r} ({made.stderr.strip()}); give a "
                             "commit, branch or tag of this repository")
        try:
            built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=work,
                                   capture_output=True, text=True)
            if built.returncode:
                raise SystemExit(f"building the C libraries of {rev} failed:\n{built.stderr}")
            built = sorted(str(p.relative_to(work)) for p in work.glob("kvlc/**/*.so"))
            paths = [p for p in TREE if (work / p).exists()]
            subprocess.run(["tar", "-C", str(work), "--exclude", "benchmarks/results", "--exclude", "__pycache__",
                            "-czf", str(tar), *paths], check=True)
            print(f"{tar.relative_to(ROOT)}: {rev} with {len(built)} C libraries ({', '.join(built)})")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work)], check=True)
    return tar


def _tracked_bytes() -> int:
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                           capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", action="store_true", help="download the wheels into .whl/ (emptied first)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=REV",
                    help="a tree of kvlc at git revision REV as .carry/NAME.tgz (repeat for old / new)")
    args = ap.parse_args(argv)
    carry = ROOT / ".carry"
    carry.mkdir(exist_ok=True)
    if args.wheels:
        wheels(ROOT / ".whl")
    for spec in args.tree:
        name, sep, rev = spec.partition("=")
        if not sep or not name.isidentifier():
            ap.error(f"--tree {spec!r}: expected NAME=REV, NAME a plain word (new=HEAD, old=58edb9b)")
        tree(name, rev, carry)
    (carry / "setup.sh").write_text(SETUP)
    sizes = {"tracked files": _tracked_bytes(), ".whl": _folder_bytes(ROOT / ".whl"), ".carry": _folder_bytes(carry)}
    total = sum(sizes.values())
    print(", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()),
          f"= {total / 2**20:.1f} of {LIMIT / 2**20:.0f} MiB" + ("" if total <= LIMIT else ": OVER the carry limit"))
    return 0 if total <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
