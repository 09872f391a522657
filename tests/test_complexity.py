"""Contract: every function under kvlc/ stays small enough for a newcomer to read in one go.

radon (a maintained complexity library) measures each function and method, closures included:
cyclomatic complexity at most MAX_COMPLEXITY, at most MAX_LINES lines from ``def`` to its last
line (docstring included). ALLOWED names exceptions, each with why it is there; it is empty, and
a test keeps it from holding a function that fits.
"""

from pathlib import Path

import radon.complexity as radon_complexity
from radon.visitors import Class

ROOT = Path(__file__).resolve().parents[1]
MAX_COMPLEXITY = 15
MAX_LINES = 60

# Functions over a limit today, as "path:Qualified.name". Each line is to be removed when its function is
# split; the test fails on a line whose function is back within the limits, so this list only shrinks.
ALLOWED: set[str] = set()


def _functions(blocks, prefix=""):
    """Every function, method and closure radon found, with its qualified name.

    radon lists a class's methods both inside the class and on their own (named ``Class.method``);
    the classes are skipped here so that each method counts once.
    """
    for block in blocks:
        if isinstance(block, Class):
            continue
        name = f"{prefix}{block.fullname}"
        yield name, block
        yield from _functions(block.closures, f"{name}.")


def _measured() -> dict[str, tuple[int, int]]:
    """``path:name`` -> (cyclomatic complexity, lines) of every function under kvlc/."""
    out = {}
    for path in sorted((ROOT / "kvlc").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for name, f in _functions(radon_complexity.cc_visit(path.read_text())):
            out[f"{where}:{name}"] = (f.complexity, f.endline - f.lineno + 1)
    return out


def _over(measure: tuple[int, int]) -> bool:
    complexity, lines = measure
    return complexity > MAX_COMPLEXITY or lines > MAX_LINES


def test_functions_stay_within_complexity_and_length():
    """No function under kvlc/ is above complexity 15 or 60 lines, except those named in ALLOWED."""
    over = {k: v for k, v in _measured().items() if _over(v) and k not in ALLOWED}
    assert not over, "split these functions (complexity, lines) into smaller ones: " + "; ".join(
        f"{k} {v}" for k, v in sorted(over.items()))


def test_allow_list_names_only_functions_still_over_a_limit():
    """Every ALLOWED entry is a function that exists and is still over a limit (the list only shrinks)."""
    measured = _measured()
    stale = sorted(k for k in ALLOWED if k not in measured or not _over(measured[k]))
    assert not stale, "remove from ALLOWED in tests/test_complexity.py (gone or within limits now): " + ", ".join(
        stale)


def test_the_measure_sees_a_long_branchy_function():
    """The radon measure counts branches and lines as this test expects (a check on the checker)."""
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16))
    f = next(iter(radon_complexity.cc_visit(f"def f(x):\n{branches}    return -1\n")))
    assert (f.complexity, f.endline - f.lineno + 1) == (17, 34)
    assert _over((f.complexity, 1)) and _over((1, 61)) and not _over((15, 60))
