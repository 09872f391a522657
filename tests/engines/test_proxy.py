"""`kvlc proxy` in front of real vLLM OpenAI servers with KvlcConnector (one prefill server, two decode
servers; one proxy 1P:1D, one 1P:2D), driven by the `openai` client: the answers equal one server's
alone, the KV came over kvlc, and a decode server that dies is taken out with no failed request."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engines.conftest import ROOT
from testkit.openai_servers import (Server, free_port, kvlc_transfer_config, refused_urls,
                                    tiny_llama_with_words, vllm_server_args, wait_all, words)

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

pytestmark = pytest.mark.engine

LOADED = "kvlc: rank 0 loads request"
SAMPLING = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """A prefill server (core 0), decode servers A (core 1) and B (core 0), a 1P:1D proxy (A), a
    1P:2D proxy (A and B), and two proxies whose (first) prefill server is not there, one of them with
    --recompute; all started in parallel."""
    tmp = tmp_path_factory.mktemp("proxy")
    model = str(tiny_llama_with_words(tmp / "tiny-words"))
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "KVLC_SECRET": "proxy-test-secret-0123456789", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    servers = {}
    with refused_urls() as (dead,), _stopping(servers):  # dead: a prefill server that is not there
        for name, role, core in (("prefill", "kv_producer", 0), ("decode", "kv_consumer", 1),
                                 ("decode_b", "kv_consumer", 0)):
            port = free_port()
            servers[name] = Server(name, vllm_server_args(model, port, kvlc_transfer_config(role)), port,
                                   tmp / f"{name}.log", {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)})
        for name, prefills, decodes, more in (
                ("proxy", ("prefill",), ("decode",), ()),
                ("proxy_2d", ("prefill",), ("decode", "decode_b"), ()),
                ("proxy_failover", (dead, "prefill"), ("decode",), ()),
                ("proxy_recompute", (dead,), ("decode",), ("--recompute",))):
            port = free_port()
            args = [sys.executable, "-m", "kvlc.cli", "proxy", "--port", str(port), "--timeout", "120",
                    "--health-interval", "1", *more]
            args += [a for p in prefills for a in ("--prefill", servers[p].url if p in servers else p)]
            args += [a for d in decodes for a in ("--decode", servers[d].url)]
            servers[name] = Server(name, args, port, tmp / f"{name}.log", env, ready_codes=(200, 503))
        wait_all(servers.values())
        servers["model"] = model
        yield servers


@contextmanager
def _stopping(servers: dict):
    try:
        yield
    finally:
        for s in servers.values():
            if isinstance(s, Server):
                s.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _tokens(choice) -> list[int]:
    return list(choice.model_extra.get("token_ids") or choice.token_ids or [])


def _completion(server, model, prompt, stream=False) -> tuple[str, list[int]]:
    out = _client(server).completions.create(model=model, prompt=prompt, stream=stream, **SAMPLING)
    if not stream:
        return out.choices[0].text, _tokens(out.choices[0])
    text, toks = "", []
    for chunk in out:
        if chunk.choices:
            text += chunk.choices[0].text
            toks += chunk.choices[0].model_extra.get("token_ids") or []
    return text, toks


def _chat(server, model, content, stream=False) -> str:
    out = _client(server).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], stream=stream, temperature=0,
        max_tokens=16, extra_body={"ignore_eos": True})
    if not stream:
        return out.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


def test_completions_through_proxy_equal_one_server_alone(pd):
    """A 150-token prompt (5 blocks of 32), streamed and not, through the proxy: the decode server
    loaded its KV through kvlc for each, and text and token ids equal the decode server's own answer
    without P/D (greedy)."""
    prompt = words(150, seed=4)
    alone = _completion(pd["decode"], pd["model"], prompt)
    assert len(alone[1]) == 16
    before = pd["decode"].log().count(LOADED)
    assert _completion(pd["proxy"], pd["model"], prompt) == alone
    assert _completion(pd["proxy"], pd["model"], prompt, stream=True) == alone
    assert pd["decode"].log().count(LOADED) == before + 2


def test_chat_through_proxy_equal_one_server_alone(pd):
    """A chat completion, streamed and not, through the proxy equals the decode server's own answer."""
    content = words(120, seed=9)
    alone = _chat(pd["decode"], pd["model"], content)
    assert alone
    before = pd["decode"].log().count(LOADED)
    assert _chat(pd["proxy"], pd["model"], content) == alone
    assert _chat(pd["proxy"], pd["model"], content, stream=True) == alone
    assert pd["decode"].log().count(LOADED) == before + 2


def test_concurrent_streams_each_equal_its_own_answer(pd):
    """Four different prompts (40-230 tokens) streamed through the proxy at once: each answer equals
    that prompt's answer from the decode server alone."""
    prompts = [words(n, seed=s) for s, n in enumerate((40, 97, 161, 230))]
    alone = [_completion(pd["decode"], pd["model"], p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _completion(pd["proxy"], pd["model"], p, stream=True), prompts))
    assert got == alone


def test_models_and_health_through_proxy(pd):
    """/v1/models lists the decode server's model; /health reports both servers healthy."""
    import json
    import urllib.request

    assert [m.id for m in _client(pd["proxy"]).models.list()] == [pd["model"]]
    with urllib.request.urlopen(pd["proxy"].url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["errors"] == 0
    assert [b["url"] for b in health["prefill"]] == [pd["prefill"].url]


def _health(server) -> dict:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def test_prefill_server_not_there_fails_over_or_recomputes(pd):
    """A prefill server that is not there: with a second prefill server the request is prefilled there
    and the KV loaded; with --recompute as the only one, the decode server computes the prompt. Both
    answers equal the answer alone."""
    prompt = words(140, seed=31)
    alone = _completion(pd["decode"], pd["model"], prompt)
    before = pd["decode"].log().count(LOADED)
    assert _completion(pd["proxy_failover"], pd["model"], prompt, stream=True) == alone
    assert pd["decode"].log().count(LOADED) == before + 1
    assert _completion(pd["proxy_recompute"], pd["model"], prompt) == alone
    assert pd["decode"].log().count(LOADED) == before + 1
    health = _health(pd["proxy_recompute"])
    assert health["recomputes"] == 1 and health["errors"] == 0 and health["status"] == "unavailable"


def test_one_prefill_two_decode_servers(pd):
    """1P:2D: six concurrent streams (30-250 tokens) through the proxy each equal the answer of one
    server alone, and both decode servers loaded KV through kvlc."""
    prompts = [words(n, seed=20 + s) for s, n in enumerate((30, 77, 128, 163, 200, 250))]
    alone = [_completion(pd["decode"], pd["model"], p) for p in prompts]
    before = [pd[d].log().count(LOADED) for d in ("decode", "decode_b")]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: _completion(pd["proxy_2d"], pd["model"], p, stream=True), prompts))
    assert got == alone
    loads = [pd[d].log().count(LOADED) - b for d, b in zip(("decode", "decode_b"), before)]
    assert sum(loads) == 6 and min(loads) >= 1, loads
    assert [b["requests"] >= 1 for b in _health(pd["proxy_2d"])["decode"]] == [True, True]


def test_dead_decode_server_is_taken_out_and_requests_go_on(pd):
    """Decode server B killed: every later request through the 1P:2D proxy is answered by A, equal to
    the answer alone; the proxy's /health names B down."""
    pd["decode_b"].proc.kill()
    pd["decode_b"].proc.wait(30)
    prompts = [words(n, seed=40 + n) for n in (50, 90, 130, 170)]
    alone = [_completion(pd["decode"], pd["model"], p) for p in prompts]
    got = [_completion(pd["proxy_2d"], pd["model"], p, stream=bool(i % 2)) for i, p in enumerate(prompts)]
    assert got == alone
    health = _health(pd["proxy_2d"])
    b = health["decode"][1]
    assert b["url"] == pd["decode_b"].url and not b["healthy"] and "cannot connect" in b["why_down"]
    assert health["errors"] == 0
