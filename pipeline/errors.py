"""The error hierarchy, grouped by who handles each error."""

from __future__ import annotations


class KVSidecarError(Exception):
    """Base of every error kvsidecar raises on purpose."""


class ConfigError(KVSidecarError):
    """A configuration file or value is invalid; the message names the key path."""


class LayoutError(KVSidecarError):
    """A KV-cache layout is malformed or cannot be stored; the message names the group."""


class ProtocolError(KVSidecarError):
    """A wire message is malformed, oversized, or violates the protocol."""


class FrameTooLarge(ProtocolError):
    """A frame larger than ``server.max_frame_bytes``."""


class TransportError(KVSidecarError):
    """A socket, shared-memory mapping or peer process failed."""


class StoreError(KVSidecarError):
    """A store backend failed as a whole (not a per-key outcome)."""


class RequestRejected(KVSidecarError):
    """The sidecar refused a request; ``code`` says why (see ``messages.ErrorCode``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class StoreUnavailable(StoreError):
    """The store is known to be down (circuit open): fail fast, retry later."""


class StoreCallAbandoned(StoreError):
    """A store call overran its timeout and was abandoned while its thread may still read
    or write the buffers it was given: they must never be handed out again."""
