"""The runtime's errors: all are :class:`~kvlc.errors.KvlcError`, most are :class:`TransferError`.

* :class:`BindingError` — a tensor does not fit its plan storage (name, expected, got).
* :class:`NixlError` — a NIXL call failed; names the operation and NIXL's status.
* :class:`HandshakeError` — a peer's handshake record or side-channel message was refused.
* :class:`ChannelError` — the side channel could not be reached or broke a frame.
* :class:`AuthError` — a side-channel peer did not prove the shared secret, or a frame was forged.
"""

from __future__ import annotations

from kvlc.errors import BindingError, KvlcError, TransferError

__all__ = ["AuthError", "BindingError", "ChannelError", "HandshakeError", "NixlError"]


class NixlError(TransferError):
    """A NIXL operation failed. ``operation`` says which, ``status`` is NIXL's status name."""

    def __init__(self, operation: str, status: str = "", detail: str = ""):
        self.operation = operation
        self.status = status
        self.detail = detail
        text = f"NIXL {operation} failed"
        if status:
            text += f": {status}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)


class HandshakeError(TransferError):
    """A handshake record or side-channel message is malformed, hostile or does not match."""


class ChannelError(TransferError):
    """The side channel failed: connection refused or lost, frame too large or truncated."""


class AuthError(ChannelError):
    """The side channel could not be authenticated: no or wrong secret, a forged or replayed frame."""
