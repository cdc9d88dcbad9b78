"""Wire messages between engines and the sidecar: frozen msgspec structs, msgpack-encoded.

Each direction is one tagged union decoded by one typed decoder. Tensors never travel
through the socket: registration sends handles (shared-memory names, offsets, strides).
"""

from __future__ import annotations

import array
import collections
import hashlib
import operator
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias

import msgspec

from pipeline.core.errors import BadLayoutFrame, BadVersion, FrameTooLarge, ProtocolError
from pipeline.core.layout import MAX_BLOCK_TOKENS, KVCacheLayout
from pipeline.core.outcomes import BlockStatus

__all__ = [
    "CUDA_IPC_HANDLE_BYTES",
    "HASH_ALGOS",
    "PROTOCOL_VERSION",
    "SIDECAR_HASH_ALGO",
    "TICKET_BYTES",
    "TOKEN_BYTES",
    "TOKEN_TYPECODE",
    "BlockReport",
    "BlockWhy",
    "Cancel",
    "Cancelled",
    "CudaIpc",
    "CudaIpcEvent",
    "EngineMessage",
    "ErrorCode",
    "ErrorReply",
    "Explain",
    "Handover",
    "HandoverTicket",
    "HashSelfTest",
    "Heartbeat",
    "HeartbeatAck",
    "Load",
    "LoadDone",
    "Lookup",
    "LookupReply",
    "Register",
    "Registered",
    "RequestKeys",
    "Save",
    "SaveDone",
    "SidecarMessage",
    "TensorHandle",
    "TokenIds",
    "Unregister",
    "Unregistered",
    "compact_keys",
    "decode_engine_message",
    "decode_sidecar_message",
    "encode",
    "keys_size",
    "outcome_counts",
    "pack_tokens",
    "prompt_length",
]

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


def _enc_hook(value: Any) -> Any:
    if isinstance(value, array.array) and value.typecode == TOKEN_TYPECODE:
        if sys.byteorder == "big":
            value = array.array(TOKEN_TYPECODE, value)
            value.byteswap()
        return value.tobytes()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is array.array:
        if not isinstance(value, bytes):
            raise TypeError(f"Expected `bytes` of uint32 token ids, got `{type(value).__name__}`")
        if len(value) > MAX_TOKENS * TOKEN_BYTES:
            raise ValueError(f"{len(value) // TOKEN_BYTES} token ids exceed the protocol's "
                             f"{MAX_TOKENS}")
        if len(value) % TOKEN_BYTES:
            raise ValueError(f"{len(value)} bytes is not a whole number of uint32 token ids")
        tokens = array.array(TOKEN_TYPECODE)
        tokens.frombytes(value)
        if sys.byteorder == "big":
            tokens.byteswap()
        return tokens
    raise NotImplementedError(f"cannot decode {kind}")


class _Wire(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    pass


class _Reply(_Wire, frozen=True, kw_only=True):
    epoch: int = 0
    """The incarnation of the sidecar that sent it: random at each start, the same for its
    whole life. A reply of another epoch than the registration's proves that the sidecar
    the engine registered with is gone (a sidecar holds its endpoint's lock for life, so
    no two incarnations run at once)."""


# -- engine -> sidecar -------------------------------------------------------------------


CUDA_IPC_HANDLE_BYTES = 64
"""Size of a CUDA IPC memory or event handle (``cudaIpcMemHandle_t``, ``cudaIpcEventHandle_t``)."""

IpcHandleBytes = Annotated[
    bytes, msgspec.Meta(min_length=CUDA_IPC_HANDLE_BYTES, max_length=CUDA_IPC_HANDLE_BYTES)
]


class CudaIpc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A CUDA allocation shared by IPC handle: the handle of its base address, its size,
    and the engine process that owns it (the sidecar lets go when that process is gone).
    A handle's ``offset`` is then bytes from the allocation's base."""

    handle: IpcHandleBytes
    allocation_bytes: Annotated[int, msgspec.Meta(gt=0, le=MAX_EXTENT)]
    pid: Annotated[int, msgspec.Meta(gt=0, le=2**31 - 1)]
    device_uuid: Name = ""
    """The GPU's UUID: processes number devices differently (``CUDA_VISIBLE_DEVICES``),
    so the sidecar finds its own index of the device by it; empty: the index is the same."""


class CudaIpcEvent(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An interprocess CUDA event on ``device`` (``torch.cuda.Event(interprocess=True)``)."""

    device: Annotated[int, msgspec.Meta(ge=0, le=1024)]
    handle: IpcHandleBytes
    device_uuid: Name = ""
    """As ``CudaIpc.device_uuid``."""


class TensorHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one layer's KV tensor lives, so the sidecar can map it without copying.

    ``block_dim`` is 0 for blocks-first tensors ``[num_blocks, ...]`` and 1 for
    K/V-first tensors ``[2, num_blocks, ...]``. Offsets are bytes, strides elements.
    """

    layer: Name
    offset: Extent
    shape: Annotated[tuple[Extent, ...], msgspec.Meta(max_length=MAX_DIMS)]
    strides: Annotated[tuple[Extent, ...], msgspec.Meta(max_length=MAX_DIMS)]
    dtype: Name
    block_dim: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0
    device: Name = "cpu"
    segment: Annotated[int, msgspec.Meta(ge=-1, le=MAX_SEGMENTS - 1)] = -1
    """CPU memory: which of the memory files the engine handed over with its
    registration's token (``Register.handover``) the tensor lies in, by index; -1 on a GPU."""
    cuda_ipc: CudaIpc | None = None
    """GPU memory (``device`` ``cuda:N``): the allocation it lies in, by IPC handle."""


class HashSelfTest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The engine's own hashes of a fixed token sequence: proves both sides hash alike."""

    token_ids: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)], ...],
        msgspec.Meta(max_length=2 * MAX_BLOCK_TOKENS),
    ]
    """Two hash blocks' worth of tokens (the sidecar refuses more than two)."""
    block_hashes: Annotated[
        tuple[Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)], ...],
        msgspec.Meta(max_length=2 * MAX_BLOCK_TOKENS),
    ]


class RequestKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Per-request inputs to block hashing besides the tokens."""

    lora_name: Name | None = None
    lora_path: Text | None = None
    cache_salt: Text | None = None
    mm_items: Annotated[
        tuple[tuple[Name, NonNegative, NonNegative], ...], msgspec.Meta(max_length=MAX_MM_ITEMS)
    ] = ()


KEPT_KEYS_BYTES = 1024
"""Request keys larger than this are remembered by digest (``compact_keys``)."""


def keys_size(keys: RequestKeys) -> int:
    """About how many bytes ``keys`` hold."""
    size = sum(len(text) for text in (keys.lora_name, keys.lora_path, keys.cache_salt) if text)
    return size + sum(len(item[0]) + 16 for item in keys.mm_items)


def compact_keys(keys: RequestKeys) -> RequestKeys:
    """``keys`` to remember: themselves when small, else each field that is set replaced
    by a digest of it, which tells keys apart as the fields would (not for hashing)."""
    if keys_size(keys) <= KEPT_KEYS_BYTES:
        return keys
    def digest(*parts: object) -> str:
        return hashlib.blake2b(_encoder.encode(parts), digest_size=16).hexdigest()
    return RequestKeys(
        lora_name=None if keys.lora_name is None else digest(keys.lora_name),
        lora_path=None if keys.lora_path is None else digest(keys.lora_path),
        cache_salt=None if keys.cache_salt is None else digest(keys.cache_salt),
        mm_items=((digest(keys.mm_items), 0, 0),) if keys.mm_items else (),
    )


SIDECAR_HASH_ALGO = "sha256_cbor"
"""The one block-hash algorithm the sidecar computes (and so can check) itself."""
HASH_ALGOS = (SIDECAR_HASH_ALGO, "sha256", "xxhash", "xxhash_cbor")
"""vLLM's ``prefix_caching_hash_algo`` names an engine may register with."""


class Register(_Wire, frozen=True, tag="register"):
    engine_id: Name
    layout: KVCacheLayout
    tensors: Annotated[tuple[TensorHandle, ...], msgspec.Meta(max_length=MAX_TENSORS)]
    self_test: HashSelfTest
    hash_seed: Name | None = None
    version: NonNegative = PROTOCOL_VERSION
    hash_algo: Name = "sha256_cbor"
    """How the engine hashes blocks. With any algorithm but ``sha256_cbor`` the sidecar
    cannot check hashes itself: every lookup, save and load must carry the engine's."""
    lookup_only: bool = False
    """A session that only looks up (vLLM's scheduler process): no tensors, no saves or
    loads."""
    handover: Annotated[bytes, msgspec.Meta(max_length=TICKET_BYTES)] = b""
    """The token of the ticket the engine's memory files were handed over with (CPU
    tensors only; ``Handover``)."""
    step_event: CudaIpcEvent | None = None
    """An event the engine records on its compute stream after each forward, before it
    asks for saves: the sidecar's copies of GPU blocks wait on it, so that they never
    read KV the engine is still writing."""


class Handover(_Wire, frozen=True, tag="handover"):
    """Ask for a ticket to hand CPU memory over with (``transport.handover``)."""

    seq: NonNegative = 0


class Heartbeat(_Wire, frozen=True, tag="heartbeat"):
    seq: NonNegative = 0


class Lookup(_Wire, frozen=True, tag="lookup"):
    seq: NonNegative
    token_ids: TokenIds
    """The prompt; with ``prompt_tokens``, only its first hash block."""
    keys: RequestKeys = RequestKeys()
    block_hashes: BlockHashes | None = None
    """The engine's own fine block hashes (vLLM's ``request.block_hashes``): the sidecar
    then skips hashing and only checks the first one against the tokens."""
    request_id: Text | None = None
    """The request this lookup is for: its hashes are kept for its next lookup, load
    and save (a request waiting to be scheduled is looked up again and again)."""
    explain: bool = False
    """Also say, block by block, why each block is or is not a hit (``LookupReply.explain``)."""
    prompt_tokens: NonNegative | None = None
    """The prompt's length, when ``token_ids`` holds only its first hash block. With the
    engine's ``block_hashes`` naming every block, that block (to check the first hash
    against) is all a lookup reads of the prompt: an 8k-token prompt is 32 KB less to
    pack, send and read. None: ``token_ids`` is the whole prompt."""


class Explain(_Wire, frozen=True, tag="explain"):
    """A lookup explained on behalf of a registered engine, with its layout and keys:
    an operator's question, so the peer asking need not be registered itself."""

    seq: NonNegative
    engine_id: Name = ""
    """The engine whose view is explained ("": the only engine registered)."""
    token_ids: TokenIds = msgspec.field(default_factory=lambda: array.array(TOKEN_TYPECODE))
    """The prompt (may be empty when ``block_hashes`` are given)."""
    keys: RequestKeys = RequestKeys()
    block_hashes: BlockHashes | None = None


class Save(_Wire, frozen=True, tag="save"):
    seq: NonNegative
    request_id: Text
    token_ids: TokenIds
    block_ids: BlockIds
    """One list per kv-cache group, block j of the request at index j (0 = null block)."""
    keys: RequestKeys = RequestKeys()
    block_hashes: BlockHashes | None = None
    """The engine's own fine block hashes (vLLM's ``request.block_hashes``): the sidecar
    then skips hashing and only checks the first one against the tokens."""
    deadline: Deadline = 0.0
    """``time.monotonic()`` on the shared host past which the sidecar starts no copy of
    the request's blocks (0: none). A copy already started is finished."""


class Load(_Wire, frozen=True, tag="load"):
    seq: NonNegative
    request_id: Text
    token_ids: TokenIds
    block_ids: BlockIds
    num_tokens: NonNegative
    """Tokens to load from the start of the request (the lookup's hit)."""
    keys: RequestKeys = RequestKeys()
    block_hashes: BlockHashes | None = None
    """The engine's own fine block hashes (vLLM's ``request.block_hashes``): the sidecar
    then skips hashing and only checks the first one against the tokens."""
    computed_tokens: NonNegative = 0
    """Tokens whose KV the engine already holds (its own prefix cache): blocks that end
    at or before this are neither needed nor written."""
    deadline: Deadline = 0.0
    """As ``Save.deadline``."""


class Cancel(_Wire, frozen=True, tag="cancel"):
    """The engine no longer waits for its save or load ``request_seq``. Answered by
    ``Cancelled`` once that request can no longer touch the engine's memory: its copies
    finished or never started, and its completion (if it had one) sent first."""

    seq: NonNegative
    request_seq: NonNegative


def prompt_length(message: Lookup | Save | Load) -> int:
    """Tokens in the request's prompt (a lookup may carry only its first hash block)."""
    if isinstance(message, Lookup) and message.prompt_tokens is not None:
        return message.prompt_tokens
    return len(message.token_ids)


class Unregister(_Wire, frozen=True, tag="unregister"):
    seq: NonNegative = 0


EngineMessage = (
    Register | Handover | Heartbeat | Lookup | Save | Load | Cancel | Unregister | Explain
)


# -- sidecar -> engine -------------------------------------------------------------------


class Registered(_Reply, frozen=True, tag="registered"):
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


class HandoverTicket(_Reply, frozen=True, tag="handover_ticket"):
    """A one-time token, good on the connection that asked, and the unix socket to pass
    memory files to with it."""

    seq: int
    token: Annotated[bytes, msgspec.Meta(max_length=TICKET_BYTES)]
    path: Text


class HeartbeatAck(_Reply, frozen=True, tag="heartbeat_ack"):
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


class LookupReply(_Reply, frozen=True, tag="lookup_reply"):
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


class SaveDone(_Reply, frozen=True, tag="save_done"):
    seq: int
    request_id: Text
    blocks: Reports
    save_credits: int = -1
    """Saves of this engine the sidecar would accept right now (0: skip saving, do not
    pin blocks for it; -1: not reported)."""


class LoadDone(_Reply, frozen=True, tag="load_done"):
    seq: int
    request_id: Text
    loaded_tokens: int
    invalid_block_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
    blocks: Reports


class Cancelled(_Reply, frozen=True, tag="cancelled"):
    """``Cancel`` ``seq`` is done: request ``request_seq`` no longer touches the engine's
    memory. Its completion, if it was running, came first and says what it did."""

    seq: int
    request_seq: int


class Unregistered(_Reply, frozen=True, tag="unregistered"):
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


class ErrorReply(_Reply, frozen=True, tag="error"):
    code: Name
    message: Text
    seq: int = 0


SidecarMessage = (
    Registered | HandoverTicket | HeartbeatAck | LookupReply | SaveDone | LoadDone
    | Cancelled | Unregistered | ErrorReply
)

_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage, dec_hook=_dec_hook)
_sidecar_decoder = msgspec.msgpack.Decoder(SidecarMessage)


def encode(message: EngineMessage | SidecarMessage) -> bytes:
    return _encoder.encode(message)


def decode_engine_message(frame: bytes, *, max_bytes: int) -> EngineMessage:
    """Decode one engine frame; any problem becomes a ``ProtocolError`` naming it."""
    if len(frame) > max_bytes:
        raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return _engine_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        _check_version(frame)
        if "at `$.layout" in str(exc):
            raise BadLayoutFrame(f"invalid KV-cache layout: {exc}") from exc
        raise ProtocolError(f"malformed engine message: {exc}") from exc
    except (msgspec.DecodeError, RecursionError) as exc:
        # A frame nested past the recursion limit (a ~1 KB one suffices) is malformed too.
        raise ProtocolError(f"malformed engine message: {exc}") from exc


class _Versioned(msgspec.Struct):
    kind: str = ""
    version: int = PROTOCOL_VERSION


_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def _check_version(frame: bytes) -> None:
    """Raise ``BadVersion`` for a registration of another protocol version, which would
    otherwise fail as malformed on the fields its version changed."""
    try:
        versioned = _version_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return
    if versioned.kind == "register" and versioned.version != PROTOCOL_VERSION:
        raise BadVersion(f"protocol version {versioned.version} is not supported "
                         f"(expected {PROTOCOL_VERSION}): upgrade the engine's kvsidecar")


def decode_sidecar_message(frame: bytes) -> SidecarMessage:
    try:
        return _sidecar_decoder.decode(frame)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ProtocolError(f"malformed sidecar message: {exc}") from exc
