"""What engines send the sidecar: registration, the scheduler's requests, cancels."""

from __future__ import annotations

import array
import hashlib
from typing import Annotated

import msgspec

from pipeline.core.layout import MAX_BLOCK_TOKENS, KVCacheLayout
from pipeline.core.messages.wire import (
    MAX_DIMS,
    MAX_EXTENT,
    MAX_HASH_BYTES,
    MAX_MM_ITEMS,
    MAX_SEGMENTS,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    TICKET_BYTES,
    TOKEN_TYPECODE,
    BlockHashes,
    BlockIds,
    Deadline,
    Extent,
    Name,
    NonNegative,
    Text,
    TokenIds,
    Wire,
)

_DIGEST_ENCODER = msgspec.msgpack.Encoder()


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
        return hashlib.blake2b(_DIGEST_ENCODER.encode(parts), digest_size=16).hexdigest()
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


class Register(Wire, frozen=True, tag="register"):
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


class Handover(Wire, frozen=True, tag="handover"):
    """Ask for a ticket to hand CPU memory over with (``transport.handover``)."""

    seq: NonNegative = 0


class Heartbeat(Wire, frozen=True, tag="heartbeat"):
    seq: NonNegative = 0


class Lookup(Wire, frozen=True, tag="lookup"):
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


class Explain(Wire, frozen=True, tag="explain"):
    """A lookup explained on behalf of a registered engine, with its layout and keys:
    an operator's question, so the peer asking need not be registered itself."""

    seq: NonNegative
    engine_id: Name = ""
    """The engine whose view is explained ("": the only engine registered)."""
    token_ids: TokenIds = msgspec.field(default_factory=lambda: array.array(TOKEN_TYPECODE))
    """The prompt (may be empty when ``block_hashes`` are given)."""
    keys: RequestKeys = RequestKeys()
    block_hashes: BlockHashes | None = None


class Save(Wire, frozen=True, tag="save"):
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


class Load(Wire, frozen=True, tag="load"):
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


class Cancel(Wire, frozen=True, tag="cancel"):
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


class Unregister(Wire, frozen=True, tag="unregister"):
    seq: NonNegative = 0


EngineMessage = (
    Register | Handover | Heartbeat | Lookup | Save | Load | Cancel | Unregister | Explain
)
