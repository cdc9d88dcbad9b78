"""The error hierarchy, grouped by who handles each error."""

from __future__ import annotations

from collections.abc import Callable


class KVSidecarError(Exception):
    """Base of every error kvsidecar raises on purpose."""


class ConfigError(KVSidecarError):
    """A configuration file or value is invalid; the message names the key path."""


class LayoutError(KVSidecarError):
    """A KV-cache layout is malformed or cannot be stored; the message names the group."""


class ProtocolError(KVSidecarError):
    """A wire message is malformed, oversized, or violates the protocol; ``code`` is the
    error code its sender is answered with (``messages.ErrorCode``)."""

    code = "bad_frame"


class FrameTooLarge(ProtocolError):
    """A frame larger than ``server.max_frame_bytes``."""

    code = "too_large"


class BadLayoutFrame(ProtocolError):
    """A registration whose layout does not decode: a value out of its schema's range."""

    code = "bad_layout"


class BadVersion(ProtocolError):
    """A registration of a protocol version this sidecar does not speak."""

    code = "bad_version"


class TransportError(KVSidecarError):
    """A socket, shared-memory mapping or peer process failed."""


class StoreError(KVSidecarError):
    """A store backend failed as a whole (not a per-key outcome)."""


class RequestRejected(KVSidecarError):
    """The sidecar refused a request; ``code`` says why (see ``messages.ErrorCode``) and
    ``detail`` is the text its sender is answered with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message


class LimitExceeded(RequestRejected):
    """A request or registration past one of the config's limits; ``limit`` names it
    (``limits.max_engines``), and so does the message its sender gets."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__("over_limit", f"{message} ({limit})")
        self.limit = limit


class InternalFailure(StoreError):
    """A stage failed on an item for a reason of its own (a bug, ``__cause__``): the item
    answers for itself as a store error would, every block failed as ``internal``."""


class StoreUnavailable(StoreError):
    """The store is known to be down (circuit open): fail fast, retry later."""


class StoreCallAbandoned(StoreError):
    """A store call overran its timeout and was abandoned while its thread may still read
    or write the buffers it was given: they must not be handed out again until it returns.

    ``when_returned(callback)`` runs ``callback`` on the event loop once the call has
    returned (at once if it already has); never, if it never returns.
    """

    def __init__(
        self, message: str, when_returned: Callable[[Callable[[], None]], None]
    ) -> None:
        super().__init__(message)
        self.when_returned = when_returned
