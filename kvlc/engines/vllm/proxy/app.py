"""The proxy's HTTP side (aiohttp): OpenAI routes in, prefill then decode out.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed or not) go
through P/D (:mod:`kvlc.engines.vllm.proxy.flow`); ``GET /v1/models`` is answered by a decode
server; ``GET /health`` reports every backend (200 when at least one prefill and one decode
server are healthy, else 503).

Failures, as the client sees them (OpenAI's error shape, ``{"error": {"message", "type", "code"}}``):

* body not a JSON object, or several prompts in one request: 400;
* more than ``max_outstanding`` requests in flight: 503 (bounded: nothing queues in the proxy);
* a backend that answers 4xx: its status and body, unchanged (the client's request is wrong);
* a backend that cannot be reached, breaks the connection or answers 5xx: 502 naming the backend
  and why (with ``recompute``, a request no prefill server can take goes to a decode server
  without params instead, which computes the prompt); ``timeout`` seconds without a byte from
  it: 504. A prefill server that fails is taken
  out and the request goes to another prefill server; a decode server that cannot be *connected
  to* is taken out and the request goes to another decode server with the same params. A decode
  request that reached its server is never sent twice: its KV load may have begun, and a second
  load of blocks the prefill engine already freed is not safe. A streamed answer that breaks
  mid-way ends with an ``error`` event and ``[DONE]``.
* the client disconnects: the backend request in flight is closed, which makes vLLM abort it
  (an aborted prefill request frees its blocks at once; see docs/proxy.md for blocks held for a
  decode that never came).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvlc.engines.vllm.proxy.backends import Backend, Pool
from kvlc.engines.vllm.proxy.flow import decode_body, one_prompt, prefill_body

log = logging.getLogger("kvlc.proxy")

_FORWARD_HEADERS = ("Authorization", "X-Request-Id")


@dataclass(frozen=True)
class ProxySettings:
    """What ``kvlc proxy`` is given: backends, where to listen, timeouts and bounds (seconds)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout: float = 300.0          # a backend silent this long (no byte): 504
    connect_timeout: float = 10.0   # connecting to a backend; longer: taken out, next one tried
    health_interval: float = 5.0    # GET /health on every backend this often (0: never)
    max_outstanding: int = 256      # requests in flight in the proxy; more: 503
    recompute: bool = False         # no prefill server can take a request: the decode server computes it


class ProxyError(Exception):
    """An answer the client gets instead of the decode server's."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error", body: bytes | None = None,
                 content_type: str = "application/json"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.body, self.content_type = body, content_type

    def response(self) -> web.Response:
        if self.body is not None:  # a backend's own 4xx answer, passed through
            return web.Response(status=self.status, body=self.body, content_type=self.content_type)
        return web.json_response(_error(self.message, self.kind, self.status), status=self.status)


def _error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def _unreachable(exc: BaseException) -> bool:
    """Errors after which the backend surely never saw the request."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))


class Proxy:
    """The P/D proxy: two pools, one HTTP client session, counters. :meth:`app` builds the aiohttp app."""

    def __init__(self, settings: ProxySettings):
        self.settings = settings
        self.prefill = Pool("prefill", settings.prefill)
        self.decode = Pool("decode", settings.decode)
        self.active = 0
        self.counts = {"requests": 0, "prefill_retries": 0, "decode_retries": 0, "no_params": 0,
                       "recomputes": 0, "errors": 0, "client_disconnects": 0}
        self._session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        s = self.settings
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=s.connect_timeout, sock_read=s.timeout)
        # a fresh connection per backend request: a kept-alive one the server closes as the request
        # is sent fails after sending, and a decode request that may have been sent is never resent
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True))
        if s.health_interval > 0:
            self._health = asyncio.create_task(self._check_health_forever())

    async def _stop(self, app) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ health
    async def _check_health_forever(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.settings.health_interval)

    async def check_health(self) -> None:
        """GET /health on every backend at once; 200 puts a backend (back) in, anything else takes it out."""
        limit = aiohttp.ClientTimeout(total=self.settings.connect_timeout)

        async def one(pool: Pool, b: Backend) -> None:
            try:
                async with self._session.get(b.url + "/health", timeout=limit) as r:
                    if r.status == 200:
                        if not b.healthy:
                            log.warning("kvlc proxy: %s server %s is healthy again", pool.role, b.url)
                        pool.mark_up(b)
                    else:
                        pool.mark_down(b, f"/health answered {r.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                pool.mark_down(b, f"/health failed: {_why(exc, self.settings.connect_timeout)}")
        await asyncio.gather(*(one(p, b) for p in (self.prefill, self.decode) for b in p.backends))

    async def health(self, request: web.Request) -> web.Response:
        ok = self.prefill.any_healthy() and self.decode.any_healthy()
        body = {"status": "ok" if ok else "unavailable", "active": self.active, **self.counts,
                "prefill": [b.state() for b in self.prefill.backends],
                "decode": [b.state() for b in self.decode.backends]}
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        try:
            for pool in (self.decode, self.prefill):
                b = pool.pick()
                if b is None:
                    continue
                try:
                    async with self._session.get(b.url + "/v1/models", headers=_headers(request)) as r:
                        return web.Response(status=r.status, body=await r.read(),
                                            content_type=r.content_type)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    pool.mark_down(b, _why(exc, self.settings.timeout))
            raise ProxyError(502, self.decode.why_none())
        except ProxyError as exc:
            return exc.response()

    # ------------------------------------------------------------------ P/D
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._pd(request, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._pd(request, "/v1/chat/completions")

    async def _pd(self, request: web.Request, path: str) -> web.StreamResponse:
        self.counts["requests"] += 1
        try:
            body = await _json_object(request)
            if self.active >= self.settings.max_outstanding:
                raise ProxyError(503, f"the proxy has {self.active} requests in flight, its bound "
                                      "(--max-outstanding); retry later", "overloaded")
            self.active += 1
            try:
                headers = _headers(request)
                params = await self._prefill_or_recompute(path, body, headers)
                return await self._decode(request, path, body, params, headers)
            finally:
                self.active -= 1
        except ProxyError as exc:
            self.counts["errors"] += 1
            log.warning("kvlc proxy: %s -> %d: %s", path, exc.status, exc.message)
            return exc.response()
        except asyncio.CancelledError:
            self.counts["client_disconnects"] += 1
            raise

    async def _prefill_or_recompute(self, path: str, body: dict, headers: dict) -> dict | None:
        """The prefill server's params; with ``recompute``, None when no prefill server could take the
        request (the decode server then computes the prompt: slower, same answer)."""
        try:
            return await self._prefill(path, body, headers)
        except ProxyError as exc:
            if not (self.settings.recompute and exc.kind == "backend_unavailable"):
                raise
            self.counts["recomputes"] += 1
            log.warning("kvlc proxy: %s; the decode server computes the prompt (--recompute)", exc.message)
            return None

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """The prefill server's ``kv_transfer_params`` (another prefill server is tried if one fails)."""
        tried: list[Backend] = []
        while (b := self.prefill.pick(exclude=tried)) is not None:
            tried.append(b)
            b.started()
            try:
                async with self._session.post(b.url + path, json=prefill_body(body), headers=headers) as r:
                    if r.status != 200:
                        await _raise_for(r, b)
                    data = await r.json(content_type=None)
                params = data.get("kv_transfer_params") if isinstance(data, dict) else None
                if params is None:
                    self.counts["no_params"] += 1
                    log.warning("kvlc proxy: prefill server %s returned no kv_transfer_params (is it started "
                                "with kvlc's connector as kv_producer?); the decode server computes the "
                                "prompt", b.url)
                return params
            except asyncio.TimeoutError as exc:
                self._timed_out(self.prefill, b, exc)  # a connect timeout: try another
            except ProxyError as exc:
                if exc.body is not None:  # a 4xx: the request is wrong for any prefill server
                    raise
                self._take_out(self.prefill, b, exc)
            except (aiohttp.ClientError, ValueError) as exc:
                self._take_out(self.prefill, b, exc)
            finally:
                b.ended()
        raise ProxyError(502, self.prefill.why_none(), "backend_unavailable")

    def _timed_out(self, pool: Pool, b: Backend, exc: asyncio.TimeoutError) -> None:
        """``b`` never connected in time: out of the pool (the caller tries another). It connected but
        sent nothing within --timeout: the client's 504."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            self._take_out(pool, b, exc)
            return
        raise ProxyError(504, f"{pool.role} server {b.url} sent nothing for {self.settings.timeout:g}s "
                              "(raise --timeout)", "backend_timeout") from None

    def _take_out(self, pool: Pool, b: Backend, exc: BaseException) -> None:
        """``b`` failed before it answered: out of the pool until /health says 200; the caller tries
        another."""
        why = _why(exc, self.settings.connect_timeout)
        pool.mark_down(b, why)
        self.counts[f"{pool.role}_retries"] += 1
        log.warning("kvlc proxy: %s server %s failed (%s); taken out, trying another", pool.role, b.url, why)

    async def _decode(self, request: web.Request, path: str, body: dict, params: dict | None,
                      headers: dict) -> web.StreamResponse:
        tried: list[Backend] = []
        while (b := self.decode.pick(exclude=tried)) is not None:
            tried.append(b)
            b.started()
            try:
                return await self._decode_on(b, request, path, decode_body(body, params), headers)
            except asyncio.TimeoutError as exc:
                self._timed_out(self.decode, b, exc)  # a connect timeout: try another
            except aiohttp.ClientError as exc:
                if not _unreachable(exc):
                    why = _why(exc, self.settings.timeout)
                    self.decode.mark_down(b, why)
                    raise ProxyError(502, f"decode server {b.url} failed: {why}", "backend_error") from None
                self._take_out(self.decode, b, exc)
            finally:
                b.ended()
        raise ProxyError(502, self.decode.why_none(), "backend_unavailable")

    async def _decode_on(self, b: Backend, request: web.Request, path: str, body: dict,
                         headers: dict) -> web.StreamResponse:
        async with self._session.post(b.url + path, json=body, headers=headers) as r:
            if r.status != 200:
                await _raise_for(r, b)
            if not body.get("stream"):
                return web.Response(status=200, body=await r.read(), content_type=r.content_type)
            kind = r.headers.get("Content-Type", "text/event-stream")
            out = web.StreamResponse(status=200, headers={"Content-Type": kind, "Cache-Control": "no-cache"})
            await out.prepare(request)
            try:
                while True:
                    try:
                        chunk = await r.content.readany()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                        await self._end_broken_stream(out, b, exc)
                        return out
                    if not chunk:
                        break
                    await out.write(chunk)
                await out.write_eof()
            except ConnectionResetError:  # the client went away: closing ``r`` makes vLLM abort the request
                self.counts["client_disconnects"] += 1
            return out

    async def _end_broken_stream(self, out: web.StreamResponse, b: Backend, exc: BaseException) -> None:
        """The decode server broke a stream the client already has a 200 and some events of: end it
        with an error event naming the server, then ``[DONE]``."""
        why = _why(exc, self.settings.timeout)
        if not isinstance(exc, asyncio.TimeoutError):
            self.decode.mark_down(b, why)
        self.counts["errors"] += 1
        msg = f"decode server {b.url} failed mid-stream: {why}"
        log.warning("kvlc proxy: %s", msg)
        event = json.dumps(_error(msg, "backend_error", 502))
        await out.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
        await out.write_eof()


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"the request body is not JSON: {exc}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ProxyError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                         "invalid_request_error")
    why = one_prompt(body)
    if why:
        raise ProxyError(400, why, "invalid_request_error")
    return body


def _headers(request: web.Request) -> dict[str, str]:
    h = {k: request.headers[k] for k in _FORWARD_HEADERS if k in request.headers}
    h.setdefault("X-Request-Id", uuid.uuid4().hex)
    return h


async def _raise_for(r: aiohttp.ClientResponse, b: Backend) -> None:
    """A backend's non-200 answer: 4xx passes through unchanged, anything else is a 502 naming it."""
    data = await r.read()
    if 400 <= r.status < 500:
        raise ProxyError(r.status, f"{b.role} server {b.url} answered {r.status}", body=data,
                         content_type=r.content_type)
    text = data.decode(errors="replace")[:500]
    raise ProxyError(502, f"{b.role} server {b.url} answered {r.status}: {text}", "backend_error")


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, ProxyError):
        return exc.message.split(" ", 3)[-1]  # "answered 500: ..." without "<role> server <url>"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return f"cannot connect: no answer in {timeout:g}s"
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer in {timeout:g}s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        detail = getattr(os_error, "strerror", None) or os_error
        return f"cannot connect: {type(os_error).__name__} ({detail})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
