"""The protocol's version, the bounds every decoded field is held to, token ids as
sent, and the base of every message."""

from __future__ import annotations

import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, TypeAlias

import msgspec

PROTOCOL_VERSION = 4
"""4: saves and loads carry a deadline and can be cancelled (``Cancel``,
``Cancelled``); every reply carries the sidecar's ``epoch``.
3: CPU memory is handed over (``Handover``, ``Register.handover``,
``TensorHandle.segment``), never named by pid, descriptor or path.
2: a lookup with the engine's block hashes may carry only the prompt's first hash
block (``Lookup.prompt_tokens``)."""

TICKET_BYTES = 32
"""A handover ticket's token."""

NonNegative = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Deadline = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
"""Seconds of ``time.monotonic()`` (0: none)."""

# Schema maxima: every peer-supplied size is bounded where it is decoded, so that no
# frame costs the sidecar more than a small multiple of its own bytes. They are generous
# bounds of the protocol; the config caps what an engine may actually ask for
# (``limits``), within them.
MAX_TOKENS = 1 << 22
"""Token ids (and so block hashes) one request may carry."""
MAX_BLOCK_IDS = 1 << 22
"""Block ids of one kv-cache group in one request."""
MAX_GROUPS = 64
"""kv-cache groups of one layout (and so block-id lists of one request)."""
MAX_TENSORS = 8192
"""Tensor handles of one registration."""
MAX_SEGMENTS = 1024
"""Memory files one engine may hand over."""
MAX_DIMS = 8
"""Dimensions of one tensor."""
MAX_EXTENT = 1 << 48
"""A tensor dimension, stride or byte offset: far beyond any machine's memory, far below
where int64 arithmetic on them could overflow."""
MAX_NAME = 256
"""An identifier: engine id, layer, model, namespace, dtype, device, multimodal id."""
MAX_TEXT = 4096
"""Free text a request carries: its id, a LoRA path, a cache salt."""
MAX_HASH_BYTES = 64
"""One block hash (vLLM's are 32 bytes, or 8-16 with xxhash)."""
MAX_MM_ITEMS = 4096
"""Multimodal items of one request."""

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
Extent = Annotated[int, msgspec.Meta(ge=0, le=MAX_EXTENT)]
BlockHashes = Annotated[
    tuple[Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)], ...],
    msgspec.Meta(max_length=MAX_TOKENS),
]
BlockIds = Annotated[
    tuple[Annotated[tuple[NonNegative, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)], ...],
    msgspec.Meta(max_length=MAX_GROUPS),
]

# A request's token ids: ``array('I')``, on the wire as one binary field of little-endian
# uint32s. A prompt travels as one copy each way instead of one msgpack integer per token,
# which the sidecar would have to turn back into an object per token (~70 µs for 4096).
if TYPE_CHECKING:
    TokenIds: TypeAlias = array.array[int]
else:
    TokenIds = array.array  # not subscriptable at run time before Python 3.12

TOKEN_TYPECODE = "I"
TOKEN_BYTES = 4
assert array.array(TOKEN_TYPECODE).itemsize == TOKEN_BYTES


def pack_tokens(values: Iterable[int]) -> TokenIds:
    """Token ids as sent; each must fit in a uint32."""
    try:
        if isinstance(values, list):  # the usual case: fromlist's loop is ~40% quicker
            tokens = array.array(TOKEN_TYPECODE)
            tokens.fromlist(values)
            return tokens
        return array.array(TOKEN_TYPECODE, values)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc


class Wire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    pass


class Reply(Wire, frozen=True, kw_only=True):
    epoch: int = 0
    """The incarnation of the sidecar that sent it: random at each start, the same for its
    whole life. A reply of another epoch than the registration's proves that the sidecar
    the engine registered with is gone (a sidecar holds its endpoint's lock for life, so
    no two incarnations run at once)."""
