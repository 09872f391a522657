"""``kvlc proxy``: an OpenAI-compatible P/D proxy in front of vLLM prefill and decode servers.

Each completion or chat completion request goes to a prefill server with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``, then to a decode server with the
``kv_transfer_params`` the prefill server returned; the client gets the decode server's answer
(streamed through when ``stream`` is true). The stages, in the order a request flows:

* :mod:`~kvlc.engines.vllm.proxy.flow`: what each backend is sent (pure functions);
* :mod:`~kvlc.engines.vllm.proxy.backends`: which backend (least outstanding, health);
* :mod:`~kvlc.engines.vllm.proxy.app`: the HTTP side (aiohttp), errors and streaming.

It speaks vLLM's NixlConnector convention, so it also fronts engines that run NixlConnector.
docs/proxy.md shows the three commands of a P/D deployment.
"""

from __future__ import annotations

from kvlc.engines.vllm.proxy.app import Proxy, ProxySettings

__all__ = ["Proxy", "ProxySettings", "serve"]


def serve(settings: ProxySettings) -> None:
    """Run the proxy until interrupted (a client that disconnects cancels its backend requests)."""
    import asyncio

    asyncio.run(_serve(settings))


async def _serve(settings: ProxySettings) -> None:
    import asyncio

    from aiohttp import web

    runner = web.AppRunner(Proxy(settings).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
        print(f"kvlc proxy ready: http://{settings.host}:{settings.port} "
              f"(prefill {', '.join(settings.prefill)}; decode {', '.join(settings.decode)})", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
