"""Proof of identity on the side channel: an Ed25519 key per agent epoch (the ``cryptography`` package).

The shared secret proves that a party belongs to the deployment; it does not prove *which* agent a
party is, and every holder of the secret can fetch any agent's :class:`~kvlc.runtime.channel.wire.Record`.
So each agent generates a fresh Ed25519 key when it starts (one per epoch), puts the public key in
its record (``key``), and every introduction (``hello``) carries a signature of the introducing
agent over this connection's channel binding (:attr:`kvlc.runtime.channel.auth.Sealed.binding`,
fresh per connection from both sides' nonces), the server's agent name and what it introduces
(:func:`introduction`). The server verifies it before it opens a session: a record replayed on
another connection, or to another server, fails the handshake and nothing is added to NIXL.

>>> me = Identity.generate()
>>> msg = introduction(b"b" * 32, "server-agent", "me", "READ", "direct")
>>> verify(me.public, me.sign(msg), msg), verify(me.public, me.sign(msg), msg + b"x")
(True, False)
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_BYTES = 32
SIGNATURE_BYTES = 64
_DOMAIN = b"kvlc introduce v3\x00"


class Identity:
    """One agent epoch's signing key (never leaves the process; the public half goes in its record)."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = key.public_key().public_bytes_raw()

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def __repr__(self) -> str:
        return f"<Identity {self.public.hex()[:16]}>"


def introduction(binding: bytes, server_agent: str, agent: str, direction: str, mode: str) -> bytes:
    """What an introduction's signature covers: this connection, the server it is made to, the agent
    introduced and what it will do (each field length-prefixed, so none can bleed into the next)."""
    parts = [binding, server_agent.encode(), agent.encode(), direction.encode(), mode.encode()]
    return _DOMAIN + b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def verify(public: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is the key ``public``'s over ``message``."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
