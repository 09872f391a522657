"""Hostile spec input → a located kvlc error, fast, and nothing else happens.

Templates run sandboxed and bounded; YAML is bounded in aliases, depth and size; every integer a
spec takes is bounded and no compiled address reaches 2**63; `--set` and `--config` errors are
kvlc errors. Inputs that could hang or eat memory run in a fresh interpreter under a generous
wall limit (a subprocess timeout, never a timed assertion) and a memory cap.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvlc
from kvlc.compiler.spec.source import load_config, parse_set, parse_yaml
from kvlc.compiler.spec.template import render_template
from kvlc.compiler.spec.validate import validate
from kvlc.errors import SpecError

ROOT = Path(__file__).resolve().parents[1]
LLAMA = (ROOT / "layouts" / "llama-3.1-8b.yaml").read_text()
WALL_S = 120          # generous: each of these finishes in about a second when it works
MEMORY_CAP = 2 << 30  # a bomb that expanded would need several GiB


def _cap_memory():  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def kvlc_cli(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The real command line in a fresh interpreter, under a wall limit and a memory cap."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvlc.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=WALL_S, preexec_fn=_cap_memory)


def refused(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 with kvlc's located message (no traceback) that contains every needle."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr[-2000:])
    return out.stderr


def template(tmp_path: Path, body: str, name: str = "t.yaml.j2") -> Path:
    path = tmp_path / name
    path.write_text("kvlc: 1\n" + body)
    return path


# ---------------------------------------------------------------- templates
ESCAPES = [
    "{{ cycler.__init__.__globals__.os.popen('touch PWNED').read() }}",
    "{{ joiner.__init__.__globals__.os.system('touch PWNED') }}",
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{{ self._TemplateReference__context }}",
    "{{ lipsum.__globals__['os'].popen('touch PWNED') }}",
    "{% set x = config.update({'a': 1}) %}",
    "{% set x = config.num_hidden_layers.__class__ %}{{ x }}",
    "{{ namespace(a=1) }}",
    "{{ config|attr('__class__') }}",
    "{{ '{0.__class__}'.format(config) }}",
    "{% set f = config.get %}{{ f.__self__ }}",
    "{{ range.__self__.__import__('os').system('touch PWNED') }}",
    "{% include '/etc/passwd' %}",
]


@pytest.mark.parametrize("escape", ESCAPES, ids=[f"escape-{i}" for i in range(len(ESCAPES))])
def test_template_cannot_reach_python(tmp_path, escape):
    """Sandbox escapes and mutation are refused at the template's line; no command runs."""
    path = template(tmp_path, f"# line 2\nname: x\n{escape}\n")
    out = kvlc_cli("render", path, "--config", ROOT / "layouts/templates/llama-3.1-70b.config.json",
                   cwd=tmp_path)
    text = refused(out, f"{path}:4:")
    assert not (tmp_path / "PWNED").exists()
    assert "fix:" in text


def test_template_includes_stay_below_its_folder(tmp_path):
    """An include may read a file below the template's folder, never '..' nor a link leading out."""
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "name.j2").write_text("name: from-include\n")
    (tmp_path / "parts" / "out.j2").symlink_to("/etc/hostname")
    assert "name: from-include" in render_template(template(tmp_path, '{% include "parts/name.j2" %}\n'))
    for target in ("../secret", "parts/out.j2", "/etc/hostname"):
        with pytest.raises(SpecError, match="not found") as info:
            render_template(template(tmp_path, f'\n{{% include "{target}" %}}\n'))
        assert info.value.problems[0].mark.line == 3


@pytest.mark.parametrize("body", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% for c in l %}{% endfor %}"
    "{% endfor %}{% endfor %}",
], ids=["nested-ranges", "exponential-macro", "self-recursive-macro", "nested-lists"])
def test_template_endless_loop_ends_with_error(tmp_path, body):
    """A template that would run (practically) forever ends with 'runs too long' / 'recursion'."""
    path = template(tmp_path, f"\n{body}\n")
    text = refused(kvlc_cli("render", path, cwd=tmp_path), f"{path}:3:")
    assert "template runs too long" in text or "template recursion too deep" in text


@pytest.mark.parametrize("body,what", [
    ("{% for i in range(100000) %}\n" + "x" * 100 + "\n{% endfor %}", "output too large"),
    ("{{ 'a' * 10**9 }}", "huge string or list"),
    ("{{ [1] * 10**9 }}", "huge string or list"),
    ("{{ 2 ** 10000000 }}", "huge number"),
    ("{{ 'a'|center(10**9) }}", "filter for a huge result"),
    ("{{ 'a'.ljust(10**9) }}", "huge string"),
    ("{{ range(10**8)|list }}", "template failed"),  # jinja's own sandbox range limit
    ("{{ '%999999999d' % 1 }}", "huge field"),
    ("{% macro sq(x, n) %}{{ sq(x * x, n - 1) if n else x }}{% endmacro %}{{ sq(2**4000, 30) }}", "huge number"),
] + [(f"{{% macro d(s, n) %}}{{{{ d({grow}, n - 1) if n else s|length }}}}{{% endmacro %}}{{{{ d('a', 60) }}}}",
      "huge value") for grow in ("s ~ s", "s + s", "s|replace('a', 'aa')", "[s, s]|join", "'%s%s' % (s, s)",
                                 "'{0}{0}'.format(s)")],
    ids=["literal-loop", "str-mul", "list-mul", "pow", "center", "ljust", "range", "percent-width", "squaring",
         "double-tilde", "double-plus", "double-replace", "double-join", "double-percent", "double-format"])
def test_template_output_and_values_are_bounded(tmp_path, body, what):
    """Output past 4 MiB, and any value that grows past it ('*', '**', '~', '+', '%', filters,
    methods, doubling through macro recursion), are refused before memory runs out."""
    path = template(tmp_path, f"\n{body}\n")
    refused(kvlc_cli("render", path, cwd=tmp_path), what, f"{path}:3:")


def test_template_errors_name_the_template_line(tmp_path):
    """Undefined names, syntax errors and failures name the template's file:line and a fix."""
    cases = {
        "\n\nname: {{ config.num_hiden_layers }}\n": (4, "did you mean 'num_hidden_layers'?"),
        "\nname: {{ tp_sise }}\n": (3, "did you mean 'tp_size'?"),
        "{% for i in range(3) %}\nname: x\n{% endfo %}\n": (4, "{% endfor %}"),
        "\n{% if 1 %}\nname: x\n": (4, "{% endif %}"),
        "\n\n\nname: {{ 1 // 0 }}\n": (5, "ZeroDivisionError"),
    }
    for body, (line, hint) in cases.items():
        path = template(tmp_path, body)
        with pytest.raises(SpecError) as info:
            render_template(path, {"num_hidden_layers": 2}, {"tp_size": 1})
        p = info.value.problems[0]
        assert (p.mark.file, p.mark.line) == (str(path), line), (body, str(p))
        assert hint in str(p) and p.fix, str(p)
        assert "jinja" not in str(p).lower()


def test_included_template_error_names_the_included_file(tmp_path):
    """An error inside an included file points at that file and its line."""
    (tmp_path / "part.j2").write_text("ok: 1\n{{ missing_var }}\n")
    path = template(tmp_path, '{% include "part.j2" %}\n')
    with pytest.raises(SpecError) as info:
        render_template(path)
    mark = info.value.problems[0].mark
    assert (Path(mark.file).name, mark.line) == ("part.j2", 2)


# ---------------------------------------------------------------- YAML
def bomb(levels: int, fan: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * fan) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]" for i in range(1, levels + 1)]
    return "kvlc: 1\n" + "\n".join(lines) + "\n"


def test_yaml_alias_bomb_fails_fast(tmp_path):
    """A depth-9 'billion laughs' (9**9 values) is refused after reading it, under a 2 GiB cap."""
    spec = tmp_path / "bomb.yaml"
    spec.write_text(bomb(9))
    refused(kvlc_cli("check", spec, cwd=tmp_path), "YAML aliases expand too far", f"{spec}:")


def test_yaml_recursive_alias_is_refused():
    """An alias inside its own anchor is a located error, not a RecursionError."""
    with pytest.raises(SpecError, match="recursive YAML alias") as info:
        parse_yaml("kvlc: 1\nname: &n [1, [*n]]\n", "x.yaml")
    assert info.value.problems[0].mark.line == 2


def test_yaml_aliases_that_stay_small_still_work():
    """Aliases are allowed; what they expand to counts against the limit, not their use."""
    assert parse_yaml("a: &x {k: [1, 2]}\nb: *x\nc: [*x, *x]\n").data["c"] == [{"k": [1, 2]}] * 2


@pytest.mark.parametrize("text", [
    "kvlc: 1\nname: " + "[" * 500 + "]" * 500 + "\n",
    "kvlc: 1\nname: " + "[" * 200_000 + "]" * 200_000 + "\n",   # crashed libyaml's composer
    "kvlc: 1\nname: " + "{a: " * 600 + "1" + "}" * 600 + "\n",
    "kvlc: 1\n" + "".join(" " * i + f"k{i}:\n" for i in range(600)),
    "kvlc: 1\nname: " + "[" * 5000 + "\n",                       # unclosed, too
], ids=["flow-500", "flow-200k", "mapping-600", "block-600", "unclosed-5000"])
def test_yaml_deep_nesting_is_a_located_error(tmp_path, text):
    """Nesting past 64 levels is refused with its line, never RecursionError or a crash."""
    spec = tmp_path / "deep.yaml"
    spec.write_text(text)
    refused(kvlc_cli("check", spec, cwd=tmp_path), "YAML nested too deeply", f"{spec}:")


def test_yaml_size_is_bounded():
    """Text past 4 MiB, or past 200,000 values, is refused before it is built."""
    with pytest.raises(SpecError, match="spec too large"):
        parse_yaml("kvlc: 1\nx: [" + "1," * 2_200_000 + "1]\n")
    with pytest.raises(SpecError, match="spec too large"):
        parse_yaml("kvlc: 1\nx: [" + "1," * 300_000 + "1]\n")


def test_huge_spec_file_is_refused_before_reading(tmp_path):
    """A 1 GiB (sparse) spec file is refused from its size, under a 2 GiB memory cap."""
    spec = tmp_path / "huge.yaml"
    with open(spec, "wb") as fh:
        fh.truncate(1 << 30)
    refused(kvlc_cli("check", spec, cwd=tmp_path), "spec too large", "1,073,741,824 bytes")


@pytest.mark.parametrize("text,line", [
    ("kvlc: 1\nmodel:\n  name: x\n   num_layers: 3\n", 4),
    ("kvlc: 1\ngroups:\n  - {name: a, kind: full_attention}\n - {name: b, kind: full_attention}\n", 4),
    ("kvlc: 1\nregions:\n  - name: a\n    storage: b\n   layout: c\n", 5),
])
def test_yaml_indentation_error_says_indentation(text, line):
    """A line indented unlike its block is called an indentation error, with the indents that fit."""
    with pytest.raises(SpecError) as info:
        parse_yaml(text, "s.yaml")
    p = info.value.problems[0]
    assert "indentation" in p.what and p.mark.line == line and "indent line" in p.fix, str(p)


# ---------------------------------------------------------------- --set and --config
@pytest.mark.parametrize("pair", ["tp_size=[1", "tp_size={a: 1", "=3", "tp size=3", "tp_size",
                                  "x=" + "[" * 1000, "x=*a", "x=!!python/object:os.system ls"],
                         ids=["unclosed-list", "unclosed-map", "no-name", "space-in-name", "no-value", "deep",
                              "unknown-alias", "python-tag"])
def test_bad_set_value_is_a_spec_error(pair):
    """Malformed --set pairs and values are SpecErrors naming --set, never YAML tracebacks."""
    with pytest.raises(SpecError) as info:
        parse_set([pair])
    assert "--set" in str(info.value)


def test_bad_set_on_the_command_line_exits_2():
    """`kvlc render ... --set tp_size=[1` prints the problem and exits 2."""
    out = kvlc_cli("render", "layouts/templates/llama-3.1-70b.yaml.j2", "--config",
                   "layouts/templates/llama-3.1-70b.config.json", "--set", "tp_size=[1")
    refused(out, "--set tp_size", "close the '[' with ']'")


@pytest.mark.parametrize("content,what", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' * 300 + "1" + "}" * 300, "nested too deeply"),
    ('{"a": 1,,}', "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    (b"\xff\xfe{}", "not UTF-8"),
], ids=["deep-array", "deep-object", "syntax", "array", "bytes"])
def test_bad_config_is_a_spec_error(tmp_path, content, what):
    """A deep, broken or non-object config.json is a located SpecError (CLI: exit 2)."""
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SpecError, match=what):
        load_config(path)
    out = kvlc_cli("render", ROOT / "layouts/templates/llama-3.1-70b.yaml.j2", "--config", path,
                   "--set", "tp_size=8", "--set", "order=nhd", cwd=tmp_path)
    refused(out, what)


# ---------------------------------------------------------------- integer bounds
BOUNDS = [
    ("num_layers: 32", "num_layers: 1180591620717411303424", "from 1 to 4,096"),
    ("num_kv_heads: 8", "num_kv_heads: 1180591620717411303424", "from 1 to 16,777,216"),
    ("head_dim: 128", "head_dim: -1", "from 1 to 16,777,216"),
    ("tp_size: 1", "tp_size: 1180591620717411303424", "from 1 to 4,096"),
    ("block_size: 16", "block_size: 1180591620717411303424", "from 1 to 1,048,576"),
    ("device: 0", "device: 1180591620717411303424", "from 0 to 1,023"),
    ("mem: VRAM,", "mem: VRAM, size: 9223372036854775808,", "from 1 to 2**63 - 1"),
    ("mem: VRAM,", "mem: VRAM, align: 9223372036854775808,", "from 1 to 2**63 - 1"),
    ("num_blocks: 4096", "num_blocks: 1180591620717411303424", "from 1 to 1,099,511,627,776"),
    ("num_blocks: 4096", "num_blocks: 4096\n        offset: 9223372036854775808", "2**63 - 1"),
    ("num_blocks: 4096", "num_blocks: 4096\n        block_stride: 9223372036854775808", "2**63 - 1"),
    ("{name: head_dim}", "{name: head_dim, size: 1180591620717411303424}", "from 1 to 16,777,216"),
    ("range: layers}\n    regions", "range: [0, 1180591620717411303424]}\n    regions", "1,048,576"),
]


@pytest.mark.parametrize("old,new,allowed", BOUNDS, ids=[
    "num_layers", "num_kv_heads", "head_dim", "tp_size", "block_size", "device", "storage-size", "align",
    "num_blocks", "offset", "block_stride", "dim-size", "repeat-range"])
def test_every_spec_integer_is_bounded(old, new, allowed):
    """Each out-of-range integer is a located error that states the allowed range."""
    assert old in LLAMA
    with pytest.raises(SpecError) as info:
        kvlc.compile_spec(LLAMA.replace(old, new, 1))
    p = info.value.problems[0]
    assert p.mark is not None and allowed in str(p), str(p)


def test_addresses_past_2_63_do_not_compile():
    """Values each in range whose product passes 2**63 are refused at the region."""
    spec = LLAMA.replace("num_blocks: 4096", "num_blocks: 1099511627776\n        block_stride: 8388608")
    with pytest.raises(SpecError, match=r"past 2\*\*63") as info:
        kvlc.compile_spec(spec)
    assert info.value.problems[0].path[-1] == "num_blocks"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(1, 2**40), stride_exp=st.integers(0, 62), offset=st.integers(0, 2**63 - 1))
def test_no_compiled_address_reaches_2_63(num_blocks, stride_exp, offset):
    """For any in-range num_blocks, block_stride and offset: a SpecError, or a plan below 2**63."""
    stride = max(65536, 1 << stride_exp)
    spec = LLAMA.replace("num_blocks: 4096", f"num_blocks: {num_blocks}\n        block_stride: {stride}"
                         f"\n        offset: {offset}")
    try:
        plan = kvlc.compile_spec(spec)
    except SpecError:
        return
    assert all(r.end < 2**63 for r in plan.regions)
    assert all(s.size < 2**63 for s in plan.storages)


# ---------------------------------------------------------------- diagnostics across repeats
def test_repeat_problems_render_as_one_line():
    """32 layers naming an unknown storage: one line with {0..31}, the count and a short list."""
    spec = LLAMA.replace('storage: "kv.{layer}"', 'storage: "kvv.{layer}"')
    with pytest.raises(SpecError) as info:
        kvlc.compile_spec(spec)
    assert len(info.value.problems) == 32
    lines = info.value.render().splitlines()
    assert len(lines) == 1, lines
    assert "'layer.{0..31}'" in lines[0] and "'kvv.{0..31}'" in lines[0] and "32 times" in lines[0]
    assert "'kv.{0..31}'" in lines[0] and "'kv.17'" not in lines[0]


def test_unknown_kind_and_key_say_did_you_mean():
    """Unknown kinds, keys and literal values in a spec suggest the closest valid one."""
    for old, new, hint in [("kind: full_attention", "kind: full_atention", "did you mean 'full_attention'?"),
                           ("num_blocks: 4096", "num_blcks: 4096", "did you mean 'num_blocks'?"),
                           ("dtype: bf16", "dtype: bf61", "did you mean 'bf16'?")]:
        with pytest.raises(SpecError) as info:
            kvlc.compile_spec(LLAMA.replace(old, new, 1))
        assert hint in info.value.render(), info.value.render()


# ---------------------------------------------------------------- properties
def _load(text: str):
    spec = validate(parse_yaml(text, "fuzz.yaml"))
    return kvlc.compile_spec(spec)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=400))
def test_garbage_text_only_raises_spec_error(text):
    """Any text at all either loads or raises SpecError — never another exception."""
    try:
        _load(text)
    except SpecError:
        pass


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(allow_nan=True),
                     st.text(max_size=12), st.sampled_from(["layers", "auto", "VRAM", "bf16", "{layer}"]))
_KEYS = st.sampled_from(["kvlc", "name", "model", "num_layers", "regions", "storages", "layouts", "groups",
                         "repeat", "range", "var", "fields", "dims", "kind", "size", "num_blocks", "x"])
_TREES = st.recursive(_SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                       st.dictionaries(_KEYS, kids, max_size=5)),
                      max_leaves=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_TREES, st.booleans())
def test_random_nested_structures_only_raise_spec_error(tree, with_version):
    """Random nested mappings and lists (with spec-like keys) raise only SpecError."""
    if with_version:
        tree = {"kvlc": 1, **tree} if isinstance(tree, dict) else {"kvlc": 1, "x": tree}
    text = yaml.safe_dump(tree)
    try:
        _load(text)
    except SpecError:
        pass


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["a: ", "- ", "[", "]", "{", "}", "&x ", "*x ", "\n", "  ", "1", ",", ": ",
                                 "!!str ", "? ", "'", '"', "#", "|", ">", "\t"]), max_size=80))
def test_yaml_token_soup_only_raises_spec_error(tokens):
    """Strings built from YAML's structural tokens (anchors, aliases, brackets) raise only SpecError."""
    try:
        _load("".join(tokens))
    except SpecError:
        pass


def test_set_values_are_plain_data():
    """A --set value is YAML data (numbers, words, lists); a self-referring alias is refused."""
    assert parse_set(["tp_size=8", "l=[1, 2]", "e="]) == {"tp_size": 8, "l": [1, 2], "e": ""}
    with pytest.raises(SpecError, match="--set x"):
        parse_set(["x=&a [1, *a]"])
