"""kvlc's runtime: move KV blocks between engines with NIXL, as a transfer program says.

One module per concern, in the order a transfer meets them:

    kinds     str enums: Direction, ConnectionMode, Status, Event
    binding   tensors ↔ plan storages (present, contiguous, memory type, device, size, no overlap)
    nixl      the one choke point for NIXL: typed errors, XferState, idempotent handles
    auth      the shared secret, HMAC handshake, sealed frames, notification tags
    wire      handshake record, side-channel messages, notifications (msgpack/JSON + pydantic)
    channel   the per-agent authenticated side-channel server and its client, bounded
    sessions  remote engines and their rank sessions (engine id, connection, epoch)
    transfer  split a request into NIXL requests, barrier, notify, fail cleanly
    staging*  bounce buffers for fragmented / mixed-memory WRITEs (policy, chunks, gather/scatter,
              wire, the receiving half, and staging_agent: what a KvAgent asks of it)
    tracking  completions: finished, failed, held, freeable; leases
    server    the side-channel request server (records, introductions, pull requests, cancels)
    replies   notifications and replies coming back to a consumer
    pump      the progress thread and background sender (weak references), owned resources
    peer      connect() and Peer: read / write
    batch     Peer.write_many / read_many: several requests as one NIXL request per part
    agent     KvAgent: register, serve, connect, expect, cancel, offer, poll, close

No layout arithmetic lives here: descriptors come from
:meth:`kvlc.compiler.pairing.pair.TransferProgram.instantiate`. nixl and torch are
imported only when an agent is created or tensors are allocated. The process
harness and the demo live in :mod:`kvlc.demo`. Usage and threat model: docs/runtime.md.
"""

from kvlc.runtime.agent import KvAgent
from kvlc.runtime.batch import BlockRequest
from kvlc.runtime.binding import Bound, allocate, bind
from kvlc.runtime.channel.tcp import Limits
from kvlc.runtime.errors import AuthError, BindingError, ChannelError, HandshakeError, NixlError
from kvlc.runtime.kinds import Direction, Event, ConnectionMode, Status
from kvlc.runtime.nixl.core import XferState
from kvlc.runtime.peer import Peer
from kvlc.runtime.staging.endpoint import StagingPolicy
from kvlc.runtime.tracking import Completions
from kvlc.runtime.channel.notifs import Notif, NotifBatch, decode_notif, encode_notif
from kvlc.runtime.channel.wire import Record

__all__ = [
    "KvAgent",
    "Peer",
    "BlockRequest",
    "StagingPolicy",
    "Completions",
    "Direction",
    "ConnectionMode",
    "Status",
    "Event",
    "Limits",
    "bind",
    "allocate",
    "Bound",
    "AuthError",
    "BindingError",
    "ChannelError",
    "HandshakeError",
    "NixlError",
    "XferState",
    "Record",
    "Notif",
    "NotifBatch",
    "encode_notif",
    "decode_notif",
]
