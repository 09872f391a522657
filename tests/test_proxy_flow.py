"""The P/D proxy against real aiohttp servers standing in for vLLM's prefill and decode OpenAI servers:
the exact request each backend sees, streaming pass-through, server choice, and every error path."""

from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvlc.engines.vllm.proxy import Proxy, ProxySettings  # noqa: E402
from testkit.openai_servers import free_port, refused_urls  # noqa: E402


class StandIn:
    """An OpenAI server stand-in: records each request; ``behave`` says how it answers."""

    def __init__(self, role: str, behave: str = "ok"):
        self.role, self.behave = role, behave
        self.seen: list[tuple[str, dict]] = []
        self.headers: list[dict] = []
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()  # a streaming decode waits on it after its first event
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body))
        self.headers.append(request.headers.copy())
        n = len(self.seen)
        try:
            return await self._answer(request, body, n)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _answer(self, request, body, n):
        b = self.behave
        if b == "400":
            return web.json_response({"error": {"message": "prompt too long", "code": 400}}, status=400)
        if b == "500":
            return web.Response(status=500, text="engine core died")
        if b == "hangup":
            request.transport.close()
            await asyncio.sleep(5)
        if b == "slow":
            await asyncio.sleep(5)
        if b == "jitter":  # answers out of order
            await asyncio.sleep((n * 7919 % 13) / 400)
        if self.role == "prefill":
            params = None if b == "no_params" else {"do_remote_prefill": True,
                                                    "remote_request_id": f"{self.url}#{n}",
                                                    "remote_block_ids": [[1, 2, 3]], "connector": "kvlc"}
            if b == "jitter":
                params["prompt_seen"] = body["prompt"]
            return web.json_response({"choices": [{"text": "P"}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": f"decoded by {self.url}"}], "got": body})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"text": "one"}]}\n\n')
        if b == "die":
            request.transport.close()
            return out
        await self.release.wait()
        await out.write(b'data: {"choices": [{"text": "two"}]}\n\ndata: [DONE]\n\n')
        return out

    async def health(self, request):
        return web.json_response({}, status=503 if self.behave == "unhealthy" else 200)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": f"model-of-{self.role}"}]})

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return runner


class Rig:
    """Stand-ins, the proxy in front of them, and a client session."""

    def __init__(self, prefill, decode, dead_prefill=0, dead_decode=0, cancel_on_disconnect=True, **settings):
        self.prefill, self.decode = prefill, decode
        self.cancel_on_disconnect = cancel_on_disconnect
        self.dead = (dead_prefill, dead_decode)
        self.settings = {"health_interval": 0, **settings}

    async def __aenter__(self):
        self.runners = [await s.start() for s in self.prefill + self.decode]
        self.refused = refused_urls(sum(self.dead))
        dead = self.refused.__enter__()
        self.dead_urls = dead
        self.proxy = Proxy(ProxySettings(prefill=tuple(dead[:self.dead[0]] + [s.url for s in self.prefill]),
                                         decode=tuple(dead[self.dead[0]:] + [s.url for s in self.decode]),
                                         **self.settings))
        runner = web.AppRunner(self.proxy.app(), handler_cancellation=self.cancel_on_disconnect)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)
        self.url = f"http://127.0.0.1:{port}"
        self.client = aiohttp.ClientSession()
        return self

    async def post(self, path, body, raw: bytes | None = None):
        async with self.client.post(self.url + path, data=raw if raw is not None else json.dumps(body),
                                    headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()

    async def __aexit__(self, *exc):
        await self.client.close()
        for r in reversed(self.runners):
            await r.cleanup()
        self.refused.__exit__(None, None, None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


BODY = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "seed": 3}


def test_completion_each_backend_sees_exactly_its_request():
    """Prefill gets the client's body with max_tokens=1, stream=False, n=1 and {"do_remote_decode": true};
    decode gets the client's body with the prefill's kv_transfer_params unchanged; the client gets
    decode's answer."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode")
        async with Rig([p], [d]) as rig:
            status, data = await rig.post("/v1/completions", BODY)
        assert status == 200
        assert p.seen == [("/v1/completions", {**BODY, "max_tokens": 1, "stream": False, "n": 1,
                                                "kv_transfer_params": {"do_remote_decode": True}})]
        params = {"do_remote_prefill": True, "remote_request_id": f"{p.url}#1",
                  "remote_block_ids": [[1, 2, 3]], "connector": "kvlc"}
        assert d.seen == [("/v1/completions", {**BODY, "kv_transfer_params": params})]
        assert json.loads(data) == {"choices": [{"text": f"decoded by {d.url}"}], "got": d.seen[0][1]}
        assert p.headers[0]["X-Request-Id"] == d.headers[0]["X-Request-Id"]
    run(go())


def test_chat_stream_passes_through_event_by_event():
    """A streamed chat: prefill gets max_tokens=max_completion_tokens=1, no stream_options, a client
    kv_transfer_params replaced; the client reads decode's first event before decode sends the rest,
    and the bytes equal decode's."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
                "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True, "from": "client"}}
        async with Rig([p], [d]) as rig:
            async with rig.client.post(rig.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                first = await r.content.readuntil(b"\n\n")
                assert first == b'data: {"choices": [{"text": "one"}]}\n\n'
                d.release.set()
                rest = await r.read()
        assert rest == b'data: {"choices": [{"text": "two"}]}\n\ndata: [DONE]\n\n'
        sent = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        assert p.seen == [("/v1/chat/completions", {**sent, "max_completion_tokens": 1, "max_tokens": 1,
                                                     "stream": False, "n": 1,
                                                     "kv_transfer_params": {"do_remote_decode": True}})]
        assert d.seen[0][1]["kv_transfer_params"]["remote_request_id"] == f"{p.url}#1"
        assert {k: v for k, v in d.seen[0][1].items() if k != "kv_transfer_params"} == \
            {k: v for k, v in body.items() if k != "kv_transfer_params"}
    run(go())


def test_servers_taken_in_turn_and_least_outstanding_first():
    """Sequential requests alternate between two prefill and two decode servers; with one decode
    server busy, the next request goes to the other."""
    async def go():
        ps, ds = [StandIn("prefill"), StandIn("prefill")], [StandIn("decode"), StandIn("decode")]
        async with Rig(ps, ds) as rig:
            for _ in range(4):
                assert (await rig.post("/v1/completions", BODY))[0] == 200
            assert [len(s.seen) for s in ps + ds] == [2, 2, 2, 2]
            busy = asyncio.create_task(rig.post("/v1/completions", {**BODY, "stream": True}))
            while sum(len(d.seen) for d in ds) < 5:
                await asyncio.sleep(0.01)
            held = next(d for d in ds if len(d.seen) == 3)
            for _ in range(2):
                assert (await rig.post("/v1/completions", BODY))[0] == 200
            assert len(held.seen) == 3  # both went to the idle one
            held.release.set()
            assert (await busy)[0] == 200
    run(go())


def test_concurrent_requests_each_decode_with_their_own_params():
    """Sixty concurrent requests over two prefill and two decode servers that answer out of order:
    each decode request carries the params its own prompt's prefill returned, and each client gets
    its own answer."""
    async def go():
        ps = [StandIn("prefill", "jitter"), StandIn("prefill", "jitter")]
        ds = [StandIn("decode", "jitter"), StandIn("decode", "jitter")]
        async with Rig(ps, ds) as rig:
            bodies = [{**BODY, "prompt": [i, i + 1, i + 2]} for i in range(60)]
            answers = await asyncio.gather(*(rig.post("/v1/completions", b) for b in bodies))
        for body, (status, data) in zip(bodies, answers):
            got = json.loads(data)["got"]
            assert status == 200 and got["prompt"] == body["prompt"]
            assert got["kv_transfer_params"]["prompt_seen"] == body["prompt"]
        assert sum(len(s.seen) for s in ds) == 60 and min(len(s.seen) for s in ps + ds) >= 15  # both used
    run(go())


def test_prefill_down_is_taken_out_and_request_goes_to_another():
    """A prefill server that refuses connections: the request goes to the next one, /health names it down."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode")
        async with Rig([p], [d], dead_prefill=1) as rig:
            for _ in range(2):
                assert (await rig.post("/v1/completions", BODY))[0] == 200
            async with rig.client.get(rig.url + "/health") as r:
                health = await r.json()
        assert len(p.seen) == 2 and health["prefill_retries"] == 1
        dead = health["prefill"][0]
        assert dead["url"] == rig.dead_urls[0] and not dead["healthy"]
        assert dead["why_down"].startswith("cannot connect: ConnectionRefusedError")
    run(go())


def test_prefill_answering_500_is_taken_out_and_request_goes_to_another():
    """A prefill server that answers 500: taken out (its why quoted in /health), the request is
    prefilled by the next one and succeeds."""
    async def go():
        bad, good, d = StandIn("prefill", "500"), StandIn("prefill"), StandIn("decode")
        async with Rig([bad, good], [d]) as rig:
            assert (await rig.post("/v1/completions", BODY))[0] == 200
            assert (await rig.post("/v1/completions", BODY))[0] == 200
            async with rig.client.get(rig.url + "/health") as r:
                health = await r.json()
        assert len(bad.seen) == 1 and len(good.seen) == 2
        assert health["prefill"][0]["why_down"] == "answered 500: engine core died"
        assert d.seen[0][1]["kv_transfer_params"]["remote_request_id"] == f"{good.url}#1"
    run(go())


def test_every_decode_down_is_502_naming_each():
    """No decode server reachable: 502 whose message names each decode server and why."""
    async def go():
        p = StandIn("prefill")
        async with Rig([p], [], dead_decode=2) as rig:
            status, data = await rig.post("/v1/completions", BODY)
        err = json.loads(data)["error"]
        assert status == 502 and err["type"] == "backend_unavailable"
        assert err["message"].startswith("no decode server could take the request: ")
        for url in rig.dead_urls:
            assert f"{url} (cannot connect: ConnectionRefusedError" in err["message"]
    run(go())


def test_every_prefill_down_is_502_or_recomputed_on_decode():
    """No prefill server reachable: 502 naming it; with --recompute the decode server gets the client's
    body without params (it computes the prompt) and the proxy counts it."""
    async def go():
        d = StandIn("decode")
        async with Rig([], [d], dead_prefill=1) as rig:
            status, data = await rig.post("/v1/completions", BODY)
            assert status == 502 and rig.dead_urls[0] in json.loads(data)["error"]["message"]
            assert d.seen == []
        async with Rig([], [d], dead_prefill=1, recompute=True) as rig:
            assert (await rig.post("/v1/completions", BODY))[0] == 200
            assert rig.proxy.counts["recomputes"] == 1
        assert d.seen == [("/v1/completions", BODY)]
    run(go())


def test_decode_that_got_the_request_is_never_tried_twice():
    """A decode server that drops the connection after reading the request: 502 naming it, and the
    other decode server never sees the request (its KV load may have begun)."""
    async def go():
        p, bad, good = StandIn("prefill"), StandIn("decode", "hangup"), StandIn("decode")
        async with Rig([p], [bad, good]) as rig:
            rig.proxy.decode.backends[1].outstanding = 1  # make the bad one the first pick
            status, data = await rig.post("/v1/completions", BODY)
        err = json.loads(data)["error"]
        assert status == 502 and err["message"].startswith(f"decode server {bad.url} failed: ")
        assert len(bad.seen) == 1 and good.seen == []
    run(go())


@pytest.mark.parametrize("raw, why", [(b"{not json", "not JSON"), (b"[1, 2]", "must be a JSON object"),
                                      (json.dumps({"prompt": ["a", "b"]}).encode(), "one prompt per request"),
                                      (json.dumps({"prompt": "a", "n": 2}).encode(), '"n": 1 only')])
def test_bad_request_is_400_and_reaches_no_backend(raw, why):
    """Bad JSON, a non-object body, a batch of prompts or n > 1: 400 saying why; no backend sees anything."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode")
        async with Rig([p], [d]) as rig:
            status, data = await rig.post("/v1/completions", None, raw=raw)
        assert status == 400 and why in json.loads(data)["error"]["message"]
        assert p.seen == [] and d.seen == []
    run(go())


def test_backend_4xx_passes_through_and_5xx_is_502():
    """A prefill server's 400 reaches the client unchanged (decode never called); a decode server's
    500 becomes 502 naming the decode server and quoting it."""
    async def go():
        p, d = StandIn("prefill", "400"), StandIn("decode")
        async with Rig([p], [d]) as rig:
            status, data = await rig.post("/v1/completions", BODY)
        assert (status, json.loads(data)) == (400, {"error": {"message": "prompt too long", "code": 400}})
        assert d.seen == []
        p, d = StandIn("prefill"), StandIn("decode", "500")
        async with Rig([p], [d]) as rig:
            status, data = await rig.post("/v1/completions", BODY)
        assert status == 502
        assert json.loads(data)["error"]["message"] == f"decode server {d.url} answered 500: engine core died"
    run(go())


def test_silent_backend_is_504_after_timeout():
    """A decode server silent longer than --timeout: 504 naming it and the setting."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode", "slow")
        async with Rig([p], [d], timeout=0.5) as rig:
            status, data = await rig.post("/v1/completions", BODY)
        msg = json.loads(data)["error"]["message"]
        assert status == 504 and msg == f"decode server {d.url} sent nothing for 0.5s (raise --timeout)"
    run(go())


def test_decode_dying_mid_stream_ends_stream_with_error_event():
    """The decode server drops a streamed answer: the client gets the events so far, an error event
    naming the server, then [DONE]."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode", "die")
        async with Rig([p], [d]) as rig:
            status, data = await rig.post("/v1/completions", {**BODY, "stream": True})
        events = [e for e in data.decode().split("\n\n") if e]
        assert status == 200 and events[0] == 'data: {"choices": [{"text": "one"}]}'
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])["error"]
        assert err["message"].startswith(f"decode server {d.url} failed mid-stream")
    run(go())


@pytest.mark.parametrize("cancel_on_disconnect", [True, False])
def test_client_disconnect_cancels_backend_request(cancel_on_disconnect):
    """A client that goes away mid-stream: the proxy notices (by cancellation, which cancels the decode
    server's request so vLLM aborts it, or by its next failed write), counts it, and keeps the decode
    server in."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode")
        async with Rig([p], [d], cancel_on_disconnect=cancel_on_disconnect) as rig:
            async with aiohttp.ClientSession() as c:
                r = await c.post(rig.url + "/v1/completions", json={**BODY, "stream": True})
                await r.content.readuntil(b"\n\n")
                r.close()
            await asyncio.sleep(0.2)
            if cancel_on_disconnect:
                await asyncio.wait_for(d.cancelled.wait(), 5)
            d.release.set()  # the decode server goes on: the proxy's write to the client fails
            while rig.proxy.active:
                await asyncio.sleep(0.01)
            backend = rig.proxy.decode.backends[0]
            assert backend.outstanding == 0 and backend.healthy, backend.state()
            counts = rig.proxy.counts
            assert counts["client_disconnects"] == 1 and counts["errors"] == 0, counts
    run(go())


def test_client_disconnect_during_prefill_cancels_prefill():
    """A client that goes away while the prefill server works: the prefill request is cancelled and
    no decode request is made."""
    async def go():
        p, d = StandIn("prefill", "slow"), StandIn("decode")
        async with Rig([p], [d]) as rig:
            task = asyncio.create_task(rig.post("/v1/completions", BODY))
            while not p.seen:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.wait_for(p.cancelled.wait(), 5)
            assert d.seen == []
    run(go())


def test_more_than_max_outstanding_is_503():
    """With --max-outstanding 1 and one request in flight, the next is answered 503 at once."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode")
        async with Rig([p], [d], max_outstanding=1) as rig:
            held = asyncio.create_task(rig.post("/v1/completions", {**BODY, "stream": True}))
            while not d.seen:
                await asyncio.sleep(0.01)
            status, data = await rig.post("/v1/completions", BODY)
            assert status == 503 and "--max-outstanding" in json.loads(data)["error"]["message"]
            d.release.set()
            assert (await held)[0] == 200
    run(go())


def test_prefill_without_params_lets_decode_compute():
    """A prefill server that returns no kv_transfer_params: decode gets the client's body without
    any, computes the prompt itself; the proxy counts it."""
    async def go():
        p, d = StandIn("prefill", "no_params"), StandIn("decode")
        async with Rig([p], [d]) as rig:
            assert (await rig.post("/v1/completions", BODY))[0] == 200
            assert rig.proxy.counts["no_params"] == 1
        assert d.seen == [("/v1/completions", BODY)]
    run(go())


def test_models_from_decode_and_health_checks():
    """/v1/models comes from a decode server; the health check takes an unhealthy backend out,
    /health answers 503 when a role has none left, and requests still try it then."""
    async def go():
        p, d = StandIn("prefill"), StandIn("decode", "unhealthy")
        async with Rig([p], [d]) as rig:
            async with rig.client.get(rig.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "model-of-decode"
            await rig.proxy.check_health()
            async with rig.client.get(rig.url + "/health") as r:
                body = await r.json()
                assert r.status == 503 and body["decode"][0]["why_down"] == "/health answered 503"
            assert (await rig.post("/v1/completions", BODY))[0] == 200  # every one out: still tried
            d.behave = "ok"
            await rig.proxy.check_health()
            async with rig.client.get(rig.url + "/health") as r:
                assert r.status == 200
    run(go())


def test_cli_on_a_busy_port_says_so_in_one_line():
    """`kvlc proxy` on a port in use exits 1 with one line naming the address, no traceback."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvlc.cli", "proxy", "--prefill", "http://127.0.0.1:1",
                            "--decode", "http://127.0.0.1:2", "--port", str(port)], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"kvlc proxy: cannot listen on 127.0.0.1:{port}: ") and r.stderr.count("\n") == 1
