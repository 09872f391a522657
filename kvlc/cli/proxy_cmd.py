"""``kvlc proxy``: run the P/D proxy in front of vLLM prefill and decode OpenAI servers."""

from __future__ import annotations

import logging
import sys

import click

from kvlc.cli.base import main


@main.command("proxy")
@click.option("--prefill", "prefill", multiple=True, required=True, metavar="URL",
              help="A prefill server (vLLM OpenAI server, kv_role kv_producer); repeatable.")
@click.option("--decode", "decode", multiple=True, required=True, metavar="URL",
              help="A decode server (kv_role kv_consumer); repeatable.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=int, help="Port to listen on.")
@click.option("--timeout", default=300.0, show_default=True, type=float,
              help="Seconds a backend may stay silent (no byte) before the client gets 504.")
@click.option("--connect-timeout", default=10.0, show_default=True, type=float,
              help="Seconds to connect to a backend before it is taken out and another one is tried.")
@click.option("--health-interval", default=5.0, show_default=True, type=float,
              help="Seconds between GET /health checks of every backend (0: none).")
@click.option("--max-outstanding", default=256, show_default=True, type=click.IntRange(min=1),
              help="Requests in flight in the proxy; more are answered 503 at once.")
@click.option("--recompute", is_flag=True,
              help="When no prefill server can take a request, let a decode server compute the prompt "
                   "(slower, same answer) instead of answering 502.")
def proxy(prefill, decode, host, port, timeout, connect_timeout, health_interval, max_outstanding,
          recompute) -> None:
    """OpenAI-compatible P/D proxy: prefill (max_tokens=1, do_remote_decode) then decode.

    \b
    kvlc proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
    """
    try:
        from kvlc.engines.vllm.proxy import ProxySettings, serve
    except ImportError as exc:
        click.echo(f"kvlc proxy needs aiohttp ({exc}); pip install 'kvlc[proxy]'", err=True)
        sys.exit(1)
    for url in prefill + decode:
        if not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{url!r}: a backend is a URL such as http://127.0.0.1:8100")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        serve(ProxySettings(prefill=prefill, decode=decode, host=host, port=port, timeout=timeout,
                            connect_timeout=connect_timeout, health_interval=health_interval,
                            max_outstanding=max_outstanding, recompute=recompute))
    except OSError as exc:
        click.echo(f"kvlc proxy: cannot listen on {host}:{port}: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
