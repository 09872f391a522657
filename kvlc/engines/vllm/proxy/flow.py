"""What each backend is sent: pure functions from the client's request body to the prefill and decode bodies.

The prefill server gets the client's request with ``max_tokens=1`` (and
``max_completion_tokens=1`` where the client set it), ``stream=False``, ``n=1`` and
``kv_transfer_params={"do_remote_decode": True}``: kvlc's connector (``request_finished``)
then keeps the prompt's blocks and answers with the params a decode engine loads them from.
The decode server gets the client's request unchanged but for ``kv_transfer_params``, which
is the dict the prefill server returned, unchanged (vLLM's NixlConnector convention).

>>> body = {"model": "m", "prompt": "Hello", "max_tokens": 20, "stream": True,
...         "stream_options": {"include_usage": True}}
>>> sorted(prefill_body(body).items())  # doctest: +NORMALIZE_WHITESPACE
[('kv_transfer_params', {'do_remote_decode': True}), ('max_tokens', 1), ('model', 'm'), ('n', 1),
 ('prompt', 'Hello'), ('stream', False)]
>>> decode_body(body, {"do_remote_prefill": True, "remote_request_id": "r1"})["kv_transfer_params"]
{'do_remote_prefill': True, 'remote_request_id': 'r1'}
>>> one_prompt({"prompt": ["a", "b"]})
'the P/D proxy takes one prompt per request; got 2 in "prompt" (send them as separate requests)'
"""

from __future__ import annotations

import copy
from typing import Any

REMOTE_DECODE = {"do_remote_decode": True}

# fields that only make sense for the tokens the client sees, which come from the decode server
_PREFILL_DROPS = ("stream_options", "min_tokens")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: one token, not streamed, blocks kept for a remote decode."""
    out = {k: copy.deepcopy(v) for k, v in body.items() if k not in _PREFILL_DROPS}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1
    out["kv_transfer_params"] = dict(REMOTE_DECODE)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The request the decode server gets: the client's, with the prefill server's params (or none,
    when the prefill server returned none: the decode server then computes the prompt itself)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def one_prompt(body: dict[str, Any]) -> str | None:
    """Why the body cannot go through P/D (None when it can): the prefill server returns one set of
    ``kv_transfer_params`` per request, for one consumer, so neither a completions batch of several
    prompts nor ``n`` > 1 samples can be handed over."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return (f'the P/D proxy takes one prompt per request; got {len(prompt)} in "prompt" '
                "(send them as separate requests)")
    n = body.get("n", 1)
    if n is not None and n != 1:
        return (f'the P/D proxy takes "n": 1 only, got {n!r}: the prefill server hands over one copy of the '
                "prompt's KV, which one decode request consumes (send n requests instead)")
    return None
