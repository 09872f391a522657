"""Stage 0 — templates: a ``*.yaml.j2`` file rendered in a jinja2 sandbox, bounded in time and size.

A template computes with its model's ``config`` and ``--set`` variables, nothing else:

* it runs in :class:`jinja2.sandbox.ImmutableSandboxedEnvironment` (no ``__globals__``, no
  ``os``, no mutation of the values it is given);
* ``{% include %}`` / ``{% import %}`` read only files below the template's own folder
  (symbolic links leading out are refused);
* every loop step and call counts against :data:`MAX_STEPS` and :data:`MAX_SECONDS`, the output
  against :data:`MAX_OUTPUT_BYTES`; ``*`` and ``**`` may not build huge strings or numbers.

Every failure is a :class:`~kvlc.errors.SpecError` at the template's own file and line, saying
what went wrong and how to fix it.
"""

from __future__ import annotations

import functools
import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvlc.errors import Mark, Problem, SpecError, did_you_mean

MAX_STEPS = 1_000_000            # loop iterations + calls of one render
MAX_SECONDS = 10.0               # wall time of one render
MAX_OUTPUT_BYTES = 4 << 20       # rendered text (the YAML loader refuses more anyway)
MAX_NUMBER_BITS = 4096           # results of ** (a 4096-bit integer is far past any byte count)
JINJA_TAGS = ("for", "endfor", "if", "elif", "else", "endif", "set", "endset", "macro", "endmacro",
              "call", "endcall", "filter", "endfilter", "include", "import", "from", "with", "endwith",
              "block", "endblock", "extends", "raw", "endraw")


class _Refused(Exception):
    """Raised inside the template (so jinja locates it): ``what`` and ``fix`` for the Problem."""

    def __init__(self, what: str, expected: str, found: str, fix: str):
        super().__init__(what)
        self.what, self.expected, self.found, self.fix = what, expected, found, fix


class _Budget:
    """Steps and seconds left to one render."""

    def __init__(self, steps: int = MAX_STEPS, seconds: float = MAX_SECONDS):
        self.steps, self.seconds = steps, seconds
        self.used = 0
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        self.used += 1
        if self.used > self.steps or (self.used % 1024 == 0 and time.monotonic() > self.deadline):
            raise _Refused("template runs too long", f"at most {self.steps:,} loop steps and calls "
                           f"within {self.seconds:g} s", f"more than {min(self.used, self.steps):,} steps",
                           "look for a loop that never ends (a macro calling itself, nested loops "
                           "over large ranges); render fewer items")


class _FolderLoader(jinja2.FileSystemLoader):
    """Loads templates from one folder and below it, never through a link leading out."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.root = folder.resolve()

    def get_source(self, environment, template):
        source, filename, uptodate = super().get_source(environment, template)
        if not Path(filename).resolve().is_relative_to(self.root):
            raise jinja2.TemplateNotFound(template, f"'{template}' leads out of {self.root}")
        return source, filename, uptodate


def _bounded(f):
    """A filter whose count and width arguments (``center(10**9)``) may not exceed the output limit."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # the context/env, the value

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        for a in (*args[skip:], *kwargs.values()):
            if isinstance(a, int) and abs(a) > MAX_OUTPUT_BYTES:
                raise _Refused("template asks a filter for a huge result",
                               f"sizes up to {MAX_OUTPUT_BYTES:,}",
                               f"{f.__name__.removeprefix('do_')}(..., {a})", "use a smaller width or count")
        return _checked(f(*args, **kwargs))
    return bounded


def _checked(value):
    """A value a template computed: strings and lists past the output limit, and numbers past
    :data:`MAX_NUMBER_BITS`, are refused as soon as they exist (before they double again)."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_OUTPUT_BYTES:
        raise _Refused("template builds a huge value", f"strings and lists up to {MAX_OUTPUT_BYTES:,} items",
                       f"a {type(value).__name__} of {len(value):,}", "build smaller values")
    if isinstance(value, int) and value.bit_length() > MAX_NUMBER_BITS:
        raise _Refused("template computes a huge number", f"integers up to {MAX_NUMBER_BITS} bits",
                       f"{value.bit_length():,} bits", "compute smaller numbers")
    return value


def _too_big(value: Any, times: Any) -> bool:
    return (isinstance(value, (str, bytes, list, tuple)) and isinstance(times, int)
            and len(value) * times > MAX_OUTPUT_BYTES)


def _huge_repeat(left, right) -> _Refused | None:
    if _too_big(left, right) or _too_big(right, left):
        return _Refused("template builds a huge string or list with '*'",
                        f"results up to {MAX_OUTPUT_BYTES:,} items", f"{type(left).__name__} * "
                        f"{type(right).__name__} past that", "repeat fewer times")
    return None


def _huge_product(left, right) -> _Refused | None:
    if (isinstance(left, int) and isinstance(right, int)
            and left.bit_length() + right.bit_length() > MAX_NUMBER_BITS + 1):
        return _Refused("template computes a huge number with '*'",
                        f"results up to {MAX_NUMBER_BITS} bits",
                        f"{left.bit_length()}-bit * {right.bit_length()}-bit", "compute smaller numbers")
    return None


def _huge_power(left, right) -> _Refused | None:
    if (isinstance(left, int) and isinstance(right, int) and right > 0
            and abs(left) > 1 and abs(left).bit_length() * right > MAX_NUMBER_BITS):
        return _Refused("template computes a huge number with '**'",
                        f"results up to {MAX_NUMBER_BITS} bits", f"{left} ** {right}",
                        "use a smaller exponent")
    return None


def _huge_format(left, right) -> _Refused | None:
    if isinstance(left, str) and any(
            int(w) > MAX_OUTPUT_BYTES for w in re.findall(r"%[-+ #0]*\.?(\d+)", left)):
        return _Refused("template formats a huge field with '%'", f"widths up to {MAX_OUTPUT_BYTES:,}",
                        repr(left[:40]), "use a smaller width")
    return None


def _huge_concat(left, right) -> _Refused | None:
    sized = (str, list, tuple)
    if isinstance(left, sized) and isinstance(right, sized) and len(left) + len(right) > MAX_OUTPUT_BYTES:
        return _Refused("template builds a huge value with '+'",
                        f"results up to {MAX_OUTPUT_BYTES:,} items",
                        f"{len(left):,} + {len(right):,}", "build smaller values")
    return None


# The checks a binary operator's operands pass before jinja computes it, in order: each returns
# the refusal of a result too large to build, or None.
_BINOP_LIMITS = {
    "*": (_huge_repeat, _huge_product),
    "**": (_huge_power,),
    "%": (_huge_format,),
    "+": (_huge_concat,),
}


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, counting every call and loop step and refusing huge ``*`` / ``**`` results."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, folder: Path, budget: _Budget):
        super().__init__(loader=_FolderLoader(folder), undefined=jinja2.StrictUndefined,
                         keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                         finalize=self._count)
        self.budget = budget
        self.written = 0
        self.filters = {name: _bounded(f) for name, f in self.filters.items()}
        self.filters["kvlc_steps"] = self._steps
        self.filters["kvlc_checked"] = _checked
        self.globals.pop("namespace", None)  # the one mutable object jinja offers

    def _count(self, value):
        """Every ``{{ ... }}`` passes here: its text counts against the output limit."""
        self.written += len(str(value))
        if self.written > MAX_OUTPUT_BYTES:
            raise _output_refused(self.written)
        return value

    def _steps(self, iterable: Iterable) -> Iterable:
        for item in iterable:
            self.budget.tick()
            yield item

    def _parse(self, source, name, filename):
        """Parse, then route every ``for`` loop's items through the step counter and every ``~``
        through the size check (jinja compiles ``~`` to a join that no hook sees)."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "kvlc_steps", [], [], None, None, lineno=loop.lineno)
        for parent in list(tree.find_all(nodes.Node)):
            for field in parent.fields:
                child = getattr(parent, field, None)
                if isinstance(child, nodes.Concat):
                    setattr(parent, field, _checked_node(child))
                elif isinstance(child, list):
                    setattr(parent, field, [_checked_node(c) if isinstance(c, nodes.Concat) else c
                                            for c in child])
        return tree

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        __self.budget.tick()
        for a in (*args, *kwargs.values()):
            _checked(a)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, list, tuple)) and any(isinstance(a, int) and abs(a) > MAX_OUTPUT_BYTES
                                                         for a in (*args, *kwargs.values())):
            raise _Refused("template asks for a huge string", f"sizes up to {MAX_OUTPUT_BYTES:,}",
                           f"{getattr(__obj, '__name__', 'a method')}({', '.join(map(repr, args))})",
                           "use a smaller width or count")
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        self.budget.tick()
        for refusal in _BINOP_LIMITS.get(operator, ()):
            refused = refusal(left, right)
            if refused is not None:
                raise refused
        return _checked(super().call_binop(context, operator, left, right))


def _checked_node(node: nodes.Expr) -> nodes.Filter:
    return nodes.Filter(node, "kvlc_checked", [], [], None, None, lineno=node.lineno)


def _output_refused(n: int) -> _Refused:
    return _Refused("template output too large", f"at most {MAX_OUTPUT_BYTES:,} characters",
                    f"more than {n:,}", "render fewer items (a loop over a larger range than meant?)")


def render_template(path: str | Path, config: Mapping | None = None,
                    overrides: Mapping | None = None) -> str:
    """Render a ``*.yaml.j2`` template with a model ``config`` and ``--set`` overrides, sandboxed.

    Inside the template ``config`` is the HuggingFace-style config.json and every override is
    also a top-level variable; undefined variables are errors.

    >>> from kvlc.compiler.spec.source import load_config
    >>> config = load_config("layouts/templates/llama-3.1-70b.config.json")
    >>> text = render_template("layouts/templates/llama-3.1-70b.yaml.j2", config,
    ...                        {"tp_size": 4, "order": "hnd"})
    >>> "tp_size: 4" in text
    True
    """
    path = Path(path)
    env = _Sandbox(path.parent, _Budget())
    variables = {"config": dict(config or {}), **(overrides or {})}
    out: list[str] = []
    size = 0
    try:
        chunks = env.get_template(path.name).generate(**variables)
        for chunk in chunks:
            out.append(chunk)
            size += len(chunk)
            if size > MAX_OUTPUT_BYTES:
                chunks.throw(_output_refused(size))  # raised at the template line writing it
    except Exception as exc:  # noqa: BLE001 — every failure inside a template becomes a located SpecError
        raise SpecError([_problem(exc, path, variables)]) from None
    return "".join(out)


def _where(exc: BaseException, path: Path) -> Mark:
    """The template line an exception came from: jinja rewrites tracebacks to template frames."""
    root = path.parent.resolve()
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return Mark(_shown(exc.filename, path), exc.lineno or 1, 1)
    mark = Mark(str(path), 1, 1)
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.endswith(".py") and _below(name, root):
            mark = Mark(_shown(name, path), tb.tb_lineno, 1)
        tb = tb.tb_next
    return mark


def _below(name: str, root: Path) -> bool:
    try:
        return Path(name).resolve().is_relative_to(root)
    except (OSError, ValueError):
        return False


def _shown(filename: str | None, path: Path) -> str:
    """A template file named as the user named the top one (relative stays relative)."""
    if not filename:
        return str(path)
    try:
        return str(path.parent / Path(filename).resolve().relative_to(path.parent.resolve()))
    except ValueError:
        return filename


def _problem(exc: BaseException, path: Path, variables: Mapping) -> Problem:
    mark = _where(exc, path)
    if isinstance(exc, _Refused):
        return Problem((), exc.what, expected=exc.expected, found=exc.found, fix=exc.fix, mark=mark)
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return _syntax(exc, mark)
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return Problem((), "template reaches outside what a template may use", expected=(
            "arithmetic, loops and filters over config values and --set variables"),
            found=_plain(str(exc)), fix="remove it: templates cannot call into Python", mark=mark)
    if isinstance(exc, jinja2.UndefinedError):
        return _undefined(exc, mark, variables)
    if isinstance(exc, jinja2.TemplateNotFound):
        return Problem((), f"template '{exc.name}' not found", expected=(
            f"a file below {path.parent or '.'} (includes and imports cannot leave the template's folder)"),
            found=str(exc.message or exc.name), fix="move the file next to the template", mark=mark)
    if isinstance(exc, RecursionError):
        return Problem((), "template recursion too deep", expected="macros that stop calling themselves",
                       found="a call chain past Python's recursion limit",
                       fix="give the recursive macro a base case", mark=mark)
    return Problem((), "template failed", expected="a template that renders",
                   found=f"{type(exc).__name__}: {_plain(str(exc))}", fix="fix the expression on this line",
                   mark=mark)


def _plain(text: str) -> str:
    return text.strip().rstrip(".")[:200]


def _undefined(exc: jinja2.UndefinedError, mark: Mark, variables: Mapping) -> Problem:
    message = str(exc.message or "undefined")
    name = re.fullmatch(r"'([^']*)' is undefined", message)
    attr = re.fullmatch(r"'dict object' has no attribute '([^']*)'", message)
    if name:
        what = f"template variable '{name.group(1)}' is not defined"
        hint = did_you_mean(name.group(1), variables)
        fix = f"pass --set {name.group(1)}=VALUE" + (f" ({hint})" if hint.startswith("did") else "")
    elif attr:
        keys = variables.get("config") or {}
        what = f"config has no key '{attr.group(1)}'"
        hint = did_you_mean(attr.group(1), [str(k) for k in keys]) if keys else "no --config was given"
        fix = f"add '{attr.group(1)}' to the config.json passed with --config ({hint})"
    else:
        what = f"template value undefined: {message}"
        fix = "check the name, or pass it with --config or --set"
    return Problem((), what, expected="a value from --config or --set", found="nothing", fix=fix, mark=mark)


def _syntax(exc: jinja2.TemplateSyntaxError, mark: Mark) -> Problem:
    message = str(exc.message or "invalid syntax")
    first = message.split(". ")[0].rstrip(".").removeprefix("Encountered ")
    first = first[:1].lower() + first[1:]
    fix = "check the '{% %}' / '{{ }}' on this line"
    looking = re.search(r"looking for the following tags: (.*?)\.", message)
    unknown = re.search(r"unknown tag '([^']*)'", message)
    if looking:
        fix = f"close the block with '{{% {_tag(looking)} %}}'"
    elif unknown:
        fix = did_you_mean(unknown.group(1), JINJA_TAGS)
    elif "end of template" in message:
        fix = "a '{% for %}', '{% if %}' or '{% macro %}' is never closed"
    return Problem((), "template syntax error", expected="a well-formed '{% tag %}' or '{{ expression }}'",
                   found=first, fix=fix, mark=mark)


def _tag(looking: re.Match) -> str:
    tags = [t.strip().strip("'") for t in looking.group(1).split(" or ")]
    return next((t for t in tags if t.startswith("end")), tags[0])
