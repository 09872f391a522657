"""kvlc's runtime: move KV blocks between engines with NIXL, as a transfer program says.

One module per concern, in the order a transfer meets them:

    binding   tensors ↔ plan storages (present, contiguous, memory type, device, size)
    nixl      the one choke point for NIXL: typed errors, XferState, idempotent handles
    wire      handshake record, side-channel messages, notifications (msgpack/JSON + pydantic)
    channel   the per-agent side-channel TCP server and its client
    transfer  split a request into NIXL requests, barrier, notify, fail cleanly
    agent     KvAgent / Peer: register, serve, connect (pair), read / write / pull-via-push, poll
    procs     agents in child processes driven over a pipe (demo, tests, benchmarks)
    demo      a producer and a consumer process on loopback, bytes checked

No layout arithmetic lives here: descriptors come from
:meth:`kvlc.compiler.pair.TransferProgram.instantiate`. nixl and torch are
imported only when an agent is created or tensors are allocated.
"""

from kvlc.runtime.agent import Completions, KvAgent, Peer
from kvlc.runtime.binding import Bound, allocate, bind
from kvlc.runtime.demo import DemoResult, cpu_plan, run_demo, scaled_plan
from kvlc.runtime.errors import BindingError, ChannelError, HandshakeError, NixlError
from kvlc.runtime.nixl import XferState
from kvlc.runtime.wire import Notif, Record, decode_notif, encode_notif

__all__ = [
    "KvAgent",
    "Peer",
    "Completions",
    "bind",
    "allocate",
    "Bound",
    "BindingError",
    "ChannelError",
    "HandshakeError",
    "NixlError",
    "XferState",
    "Record",
    "Notif",
    "encode_notif",
    "decode_notif",
    "run_demo",
    "DemoResult",
    "cpu_plan",
    "scaled_plan",
]
