"""vLLM's KV-connector API read from vLLM's source with ``ast`` (never imported), and kvlc's connector
checked against it.

vLLM 0.34 ships GPU builds only (importing its connector base needs CUDA), so its API is read from
the files of its wheel. :func:`declared` turns a class of a source file into :class:`Member` s (kind,
parameters, abstract or not); :func:`implemented` does the same for a live class by introspection;
:func:`hook_problems` compares the two; :func:`config_reads` finds every ``KVTransferConfig`` field a
package reads. Every problem is one line: where, what vLLM declares, what kvlc has, what to do.

>>> src = "class B:\\n    def hook(self, request, block_ids): ...\\n"
>>> class C:
...     def hook(self, request, blocks): ...
>>> hook_problems(C, declared(src, "B"), "B")
["C.hook: parameter 2 is 'block_ids' in B, 'blocks' in kvlc (a call by keyword fails); rename it"]
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

POSITIONAL, KEYWORD, VAR_POSITIONAL, VAR_KEYWORD = "positional", "keyword", "*args", "**kwargs"
BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
CONFIG_MODULE = "vllm.config.kv_transfer"
CONFIG_CLASS = "KVTransferConfig"


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # POSITIONAL (positional or keyword; positional-only counts too), KEYWORD, VAR_*
    default: bool


@dataclass(frozen=True)
class Member:
    """One name of a class: ``kind`` is method, classmethod, staticmethod, property or attribute."""

    name: str
    kind: str
    params: tuple[Param, ...] = ()  # without self / cls
    abstract: bool = False


# ------------------------------------------------------------------ the wheel
def wheel(version: str, cache: Path | None = None) -> Path:
    """vLLM ``version``'s wheel, downloaded once (``pip download --no-deps``) into ``cache``
    (default ``$KVLC_CACHE`` or ``~/.cache/kvlc``, then ``vllm-<version>/``); RuntimeError with pip's
    own words when it cannot be downloaded."""
    root = cache or Path(os.environ.get("KVLC_CACHE", "~/.cache/kvlc")).expanduser()
    where = root / f"vllm-{version}"
    for path in sorted(where.glob(f"vllm-{version}-*.whl")):
        if zipfile.is_zipfile(path):
            return path
        path.unlink()  # a download cut short
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(where)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    found = [p for p in sorted(where.glob(f"vllm-{version}-*.whl")) if zipfile.is_zipfile(p)]
    if done.returncode != 0 or not found:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): {' | '.join(tail)}")
    return found[0]


def module_source(wheel_path: Path, module: str) -> str:
    """The text of ``module`` (dotted name) inside a wheel."""
    name = module.replace(".", "/") + ".py"
    with zipfile.ZipFile(wheel_path) as z:
        try:
            return z.read(name).decode()
        except KeyError:
            raise FileNotFoundError(f"{wheel_path.name} has no {name}") from None


def installed_source(module: str) -> str:
    """The text of an installed module's file, read without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{module} is not installed")
    return Path(spec.origin).read_text()


# ------------------------------------------------------------------ declared (source) and implemented (live)
def _params(args: ast.arguments) -> tuple[Param, ...]:
    pos = list(args.posonlyargs) + list(args.args)
    first_default = len(pos) - len(args.defaults)
    out = [Param(a.arg, POSITIONAL, i >= first_default) for i, a in enumerate(pos)]
    if args.vararg:
        out.append(Param(args.vararg.arg, VAR_POSITIONAL, True))
    out += [Param(a.arg, KEYWORD, d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append(Param(args.kwarg.arg, VAR_KEYWORD, True))
    return tuple(out)


def _decorators(node: ast.FunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def _function(node: ast.FunctionDef) -> Member:
    deco = _decorators(node)
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in deco), "method")
    params = _params(node.args)
    if kind != "staticmethod":
        params = params[1:]
    return Member(node.name, kind, params, "abstractmethod" in deco)


def declared(source: str, class_name: str) -> dict[str, Member]:
    """Every method, property and attribute ``class_name`` declares in ``source`` (attributes: assigned
    in the class body or as ``self.x = ...`` in ``__init__``)."""
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise LookupError(f"no class {class_name} in the source")
    out: dict[str, Member] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = _function(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = Member(node.target.id, "attribute")
        elif isinstance(node, ast.Assign):
            out.update({t.id: Member(t.id, "attribute") for t in node.targets if isinstance(t, ast.Name)})
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    for node in ast.walk(init) if init is not None else ():
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            out.setdefault(node.attr, Member(node.attr, "attribute"))
    return out


def _live_params(fn) -> tuple[Param, ...]:
    kinds = {inspect.Parameter.POSITIONAL_ONLY: POSITIONAL, inspect.Parameter.POSITIONAL_OR_KEYWORD: POSITIONAL,
             inspect.Parameter.KEYWORD_ONLY: KEYWORD, inspect.Parameter.VAR_POSITIONAL: VAR_POSITIONAL,
             inspect.Parameter.VAR_KEYWORD: VAR_KEYWORD}
    params = list(inspect.signature(fn).parameters.values())
    return tuple(Param(p.name, kinds[p.kind], p.default is not p.empty or kinds[p.kind].startswith("*"))
                 for p in params)


def _live(name: str, value) -> Member:
    if isinstance(value, classmethod):
        return Member(name, "classmethod", _live_params(value.__func__)[1:])
    if isinstance(value, staticmethod):
        return Member(name, "staticmethod", _live_params(value.__func__))
    if isinstance(value, property):
        return Member(name, "property")
    if inspect.isfunction(value):
        return Member(name, "method", _live_params(value)[1:], getattr(value, "__isabstractmethod__", False))
    return Member(name, "attribute")


def own_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that are not vLLM's (nor ``object``/``ABC``)."""
    return [c for c in cls.__mro__ if not c.__module__.startswith(("vllm.", "builtins", "abc"))]


def implemented(cls: type) -> dict[str, Member]:
    """Every name ``cls`` and its non-vLLM bases define (dunders other than ``__init__`` left out)."""
    out: dict[str, Member] = {}
    for c in reversed(own_classes(cls)):
        for name, value in vars(c).items():
            if name == "__init__" or not name.startswith("__"):
                out[name] = _live(name, value)
    return out


# ------------------------------------------------------------------ the checks
def _positional(params) -> list[Param]:
    return [p for p in params if p.kind == POSITIONAL]


def signature_problems(where: str, base: tuple[Param, ...], impl: tuple[Param, ...], version: str) -> list[str]:
    """Every call ``base``'s signature allows must be one ``impl`` accepts, binding each argument to
    the parameter of the same name."""
    out = []
    kinds = {p.kind for p in impl}
    b_pos, i_pos = _positional(base), _positional(impl)
    for i, b in enumerate(b_pos):
        if i >= len(i_pos):
            if VAR_POSITIONAL not in kinds:
                out.append(f"{where}: {version} passes '{b.name}' as argument {i + 1}; kvlc's takes "
                           f"{len(i_pos)} (add the parameter)")
            continue
        if i_pos[i].name != b.name:
            out.append(f"{where}: parameter {i + 1} is '{b.name}' in {version}, '{i_pos[i].name}' in kvlc "
                       "(a call by keyword fails); rename it")
        elif b.default and not i_pos[i].default:
            out.append(f"{where}: {version} may leave out '{b.name}'; kvlc's has no default for it (add one)")
    by_name = {p.name: p for p in impl}
    for b in base:
        if b.kind == KEYWORD and by_name.get(b.name, Param("", "", False)).kind not in (POSITIONAL, KEYWORD) \
                and VAR_KEYWORD not in kinds:
            out.append(f"{where}: {version} passes '{b.name}=' by keyword; kvlc's does not take it (add it)")
        if b.kind in (VAR_POSITIONAL, VAR_KEYWORD) and b.kind not in kinds:
            out.append(f"{where}: {version} declares {b.kind} ({b.name}); kvlc's has none (add {b.kind})")
    known = {b.name for b in base}
    for p in impl:
        if p.name not in known and not p.default and p not in i_pos[: len(b_pos)]:
            out.append(f"{where}: kvlc's requires '{p.name}', which {version} never passes (give it a default)")
    return out


def hook_problems(cls: type, base: Mapping[str, Member], version: str,
                  newer: Iterable[str] = ()) -> list[str]:
    """Where ``cls`` disagrees with ``base`` (the vLLM classes it derives from, merged): every name it
    defines that vLLM declares must have vLLM's kind and a compatible signature; a public name vLLM
    does not declare is a hook vLLM never calls (``newer``: names a later vLLM declares, allowed); every
    abstract method must be implemented."""
    out = []
    impl = implemented(cls)
    for name, m in sorted(impl.items()):
        where = f"{cls.__name__}.{name}"
        b = base.get(name)
        if b is None:
            if not name.startswith("_") and name not in newer:
                out.append(f"{where}: {version} declares no such hook (renamed or removed?); vLLM never calls it")
            continue
        if b.kind != m.kind and "attribute" not in (b.kind, m.kind):
            out.append(f"{where}: a {b.kind} in {version}, a {m.kind} in kvlc; make it a {b.kind}")
        elif m.kind in ("method", "classmethod", "staticmethod"):
            out += signature_problems(where, b.params, m.params, version)
    for name, b in sorted(base.items()):
        if b.abstract and (name not in impl or impl[name].abstract):
            out.append(f"{cls.__name__}.{name}: abstract in {version}, not implemented by kvlc (implement it)")
    return out


def base_members(sources: Mapping[str, str], cls: type) -> dict[str, Member]:
    """The merged members of the vLLM classes ``cls`` derives from, read from ``sources`` (module → text);
    the first declaration along the MRO wins."""
    out: dict[str, Member] = {}
    for c in reversed([c for c in cls.__mro__ if c.__module__.startswith("vllm.")]):
        out.update(declared(sources[c.__module__], c.__name__))
    return out


def _self_names(source: str, own: set[str]) -> dict[str, int]:
    """``self.x`` / ``super().x`` names a class's source reads, which it does not define itself."""
    out: dict[str, int] = {}
    stores = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)
              and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    for n in ast.walk(ast.parse(source)):
        if not isinstance(n, ast.Attribute) or isinstance(n.ctx, ast.Store):
            continue
        v = n.value
        is_self = isinstance(v, ast.Name) and v.id == "self"
        is_super = isinstance(v, ast.Call) and getattr(v.func, "id", "") == "super"
        if (is_self and n.attr not in own and n.attr not in stores) or is_super:
            out.setdefault(n.attr, n.lineno)
    return out


def reliance_problems(cls: type, base: Mapping[str, Member], version: str) -> list[str]:
    """What ``cls``'s own source reads from vLLM's base class (``self._kv_cache_config``,
    ``super().bind_connector_metadata`` ...) must exist in ``base``."""
    out = []
    for c in own_classes(cls):
        src = inspect.getsource(c)
        for name, line in sorted(_self_names(src, set(implemented(cls))).items()):
            if name not in base:
                out.append(f"{c.__name__} (line {line} of its class): reads self.{name} / super().{name}, "
                           f"which {version}'s base classes do not declare")
    return out


# ------------------------------------------------------------------ KVTransferConfig
def _config_exprs(fn: ast.AST) -> set[str]:
    """Local names bound to a KVTransferConfig in ``fn`` (``ktc = vllm_config.kv_transfer_config``)."""
    names = {"kv_transfer_config"}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and _is_config(n.value, names):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def _is_config(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in ("kv_transfer_config", "_kv_transfer_config")
    return isinstance(node, ast.Name) and node.id in names


def config_reads(files: Iterable[Path]) -> dict[str, list[str]]:
    """Every ``KVTransferConfig`` field the files read (``x.kv_transfer_config.f``, a local bound to
    it, a parameter named ``kv_transfer_config``, ``getattr(<config>, "f")``) → where (file:line)."""
    out: dict[str, list[str]] = {}
    for path in files:
        tree = ast.parse(Path(path).read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            names = _config_exprs(fn)
            for n in ast.walk(fn):
                field = None
                if isinstance(n, ast.Attribute) and _is_config(n.value, names):
                    field = n.attr
                elif (isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr" and len(n.args) >= 2
                      and _is_config(n.args[0], names) and isinstance(n.args[1], ast.Constant)):
                    field = n.args[1].value
                if field is not None:
                    out.setdefault(field, []).append(f"{path}:{n.lineno}")
    return {k: sorted(set(v)) for k, v in out.items()}


def config_problems(reads: Mapping[str, list[str]], fields: Mapping[str, Member], version: str) -> list[str]:
    """Every field read must be one ``KVTransferConfig`` declares."""
    return [f"{where[0]}: reads KVTransferConfig.{name}, which {version} does not have "
            f"(declared: {', '.join(sorted(k for k, m in fields.items() if m.kind == 'attribute'))}); "
            "read kv_connector_extra_config instead"
            for name, where in sorted(reads.items()) if name not in fields]
