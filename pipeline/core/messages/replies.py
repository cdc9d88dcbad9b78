"""What the sidecar answers: registrations, lookups, block reports, errors."""

from __future__ import annotations

import collections
import operator
from collections.abc import Iterable
from typing import Annotated

import msgspec

from pipeline.core.messages.wire import (
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_HASH_BYTES,
    PROTOCOL_VERSION,
    TICKET_BYTES,
    Name,
    Reply,
    Text,
)
from pipeline.core.outcomes import BlockStatus


class Registered(Reply, frozen=True, tag="registered"):
    engine_id: Name
    hash_block_size: int
    lookup_alignment: int
    store_group_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_GROUPS)]
    """kv-cache group ids that are stored, in store-group order."""
    layout_fingerprint: Name
    save_capacity_blocks: int
    """Blocks the staging pool can hold at once: a hint for skipping saves early."""
    version: int = PROTOCOL_VERSION
    value_format: Name = "native"
    """How the sidecar lays values out (``store.value_format``): ``vllm`` values span every
    stored layer of a block id, so a save cannot be split by kv-cache group."""


class HandoverTicket(Reply, frozen=True, tag="handover_ticket"):
    """A one-time token, good on the connection that asked, and the unix socket to pass
    memory files to with it."""

    seq: int
    token: Annotated[bytes, msgspec.Meta(max_length=TICKET_BYTES)]
    path: Text


class HeartbeatAck(Reply, frozen=True, tag="heartbeat_ack"):
    seq: int = 0


class BlockWhy(msgspec.Struct, frozen=True, array_like=True):
    """Why one block of a looked-up prompt is or is not a hit."""

    group_id: int
    """The kv-cache group id."""
    block_index: int
    block_hash: Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
    verdict: Name
    """``pipeline.state.history.Verdict``: present, never_stored, skipped, evicted, ..."""
    reason: Text = ""
    age_s: float = -1.0
    """How long ago what the verdict says happened (-1: unknown)."""


class LookupReply(Reply, frozen=True, tag="lookup_reply"):
    seq: int
    hit_tokens: int
    save_credits: int = -1
    """Saves of this engine the sidecar would accept right now (0: skip saving, do not
    pin blocks for it; -1: not reported)."""
    explain: Annotated[
        tuple[BlockWhy, ...], msgspec.Meta(max_length=MAX_GROUPS * MAX_BLOCK_IDS)
    ] | None = None
    """Asked for (``Lookup.explain``): every full block of every stored group."""


class BlockReport(msgspec.Struct, frozen=True, array_like=True):
    """The outcome of one engine block: (kv-cache group id, block index, block id, status)."""

    group_id: int
    block_index: int
    block_id: int
    status: BlockStatus
    reason: Text = ""


def outcome_counts(blocks: Iterable[BlockReport]) -> collections.Counter[tuple[BlockStatus, str]]:
    """Blocks by status and the kind of their reason (a reason may carry details after a
    colon, "size_mismatch: ...": only its kind is counted)."""
    exact = collections.Counter(map(_STATUS_AND_REASON, blocks))  # one C loop over the blocks
    counts: collections.Counter[tuple[BlockStatus, str]] = collections.Counter()
    for (status, reason), count in exact.items():
        counts[status, reason.split(":", 1)[0]] += count
    return counts


_STATUS_AND_REASON = operator.attrgetter("status", "reason")


Reports = Annotated[tuple[BlockReport, ...], msgspec.Meta(max_length=MAX_GROUPS * MAX_BLOCK_IDS)]


class SaveDone(Reply, frozen=True, tag="save_done"):
    seq: int
    request_id: Text
    blocks: Reports
    save_credits: int = -1
    """Saves of this engine the sidecar would accept right now (0: skip saving, do not
    pin blocks for it; -1: not reported)."""


class LoadDone(Reply, frozen=True, tag="load_done"):
    seq: int
    request_id: Text
    loaded_tokens: int
    invalid_block_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
    blocks: Reports


class Cancelled(Reply, frozen=True, tag="cancelled"):
    """``Cancel`` ``seq`` is done: request ``request_seq`` no longer touches the engine's
    memory. Its completion, if it was running, came first and says what it did."""

    seq: int
    request_seq: int


class Unregistered(Reply, frozen=True, tag="unregistered"):
    seq: int = 0


class ErrorCode:
    BAD_FRAME = "bad_frame"
    TOO_LARGE = "too_large"
    BAD_VERSION = "bad_version"
    NOT_REGISTERED = "not_registered"
    BAD_LAYOUT = "bad_layout"
    BAD_TENSORS = "bad_tensors"
    HASH_MISMATCH = "hash_mismatch"
    BAD_REQUEST = "bad_request"
    SHUTTING_DOWN = "shutting_down"
    OVER_LIMIT = "over_limit"
    """A request or registration past one of the sidecar's limits (the message names it)."""
    INTERNAL = "internal"
    """The sidecar failed to handle a message: a bug of its own, never the sender's."""


class ErrorReply(Reply, frozen=True, tag="error"):
    code: Name
    message: Text
    seq: int = 0


SidecarMessage = (
    Registered | HandoverTicket | HeartbeatAck | LookupReply | SaveDone | LoadDone
    | Cancelled | Unregistered | ErrorReply
)
