"""kvlc's runtime: move KV blocks between engines with NIXL, as a transfer program says.

A package per concern, the layers in the order a transfer meets them (the import contract in
pyproject.toml states them; lower layers never import higher ones):

    nixl/      the one door to NIXL: typed errors, XferState, idempotent handles, UCX options, warm-up
    channel/   the authenticated side channel: secret and HMAC (auth), frames, wire, notifications,
               the server and client (tcp), sessions of remote engines
    staging/   bounce buffers for fragmented / mixed-memory WRITEs (policy, copies, wire, endpoint,
               and the Stager a KvAgent asks)
    kinds, errors, arguments, binding, tracking, pump
               str enums (Direction, ConnectionMode, Status, Event), checks, tensors ↔ storages,
               completions (finished, failed, held, freeable), the progress thread and sender
    transfer   split a request into NIXL requests, barrier, notify; the fence (held until NIXL ends a part)
    replies, batch   what comes back from remote ranks; several requests as one NIXL request per part
    peer, server, settings   connect() and Peer (read / write); the side-channel request server;
               AgentSettings (explicit > KVLC_* > default)
    agent      KvAgent: owns its state; the others ask it through its public methods

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
from kvlc.runtime.discovery import EngineAddress, Registry, RegistryError
from kvlc.runtime.peer import Peer
from kvlc.runtime.settings import AgentSettings
from kvlc.runtime.staging.endpoint import StagingPolicy
from kvlc.runtime.tracking import Completions
from kvlc.runtime.channel.notifs import Notif, NotifBatch, decode_notif, encode_notif
from kvlc.runtime.channel.wire import Record

__all__ = [
    "KvAgent",
    "AgentSettings",
    "Registry",
    "EngineAddress",
    "RegistryError",
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
