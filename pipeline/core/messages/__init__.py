"""Wire messages between engines and the sidecar: frozen msgspec structs, msgpack-encoded.

Each direction is one tagged union decoded by one typed decoder (here, the one codec
both sides use). Tensors never travel through the socket: registration sends handles
(shared-memory names, offsets, strides). ``wire`` holds the bounds every field is
decoded against, ``requests`` what engines send and ``replies`` what the sidecar
answers.
"""

from __future__ import annotations

import array
import sys
from typing import Any

import msgspec

from pipeline.core.errors import BadLayoutFrame, BadVersion, FrameTooLarge, ProtocolError
from pipeline.core.messages.replies import (
    BlockReport,
    BlockWhy,
    Cancelled,
    ErrorCode,
    ErrorReply,
    HandoverTicket,
    HeartbeatAck,
    LoadDone,
    LookupReply,
    Registered,
    Reports,
    SaveDone,
    SidecarMessage,
    Unregistered,
    outcome_counts,
)
from pipeline.core.messages.requests import (
    CUDA_IPC_HANDLE_BYTES,
    HASH_ALGOS,
    KEPT_KEYS_BYTES,
    SIDECAR_HASH_ALGO,
    Cancel,
    CudaIpc,
    CudaIpcEvent,
    EngineMessage,
    Explain,
    Handover,
    HashSelfTest,
    Heartbeat,
    IpcHandleBytes,
    Load,
    Lookup,
    Register,
    RequestKeys,
    Save,
    TensorHandle,
    Unregister,
    compact_keys,
    keys_size,
    prompt_length,
)
from pipeline.core.messages.wire import (
    MAX_BLOCK_IDS,
    MAX_DIMS,
    MAX_EXTENT,
    MAX_GROUPS,
    MAX_HASH_BYTES,
    MAX_MM_ITEMS,
    MAX_NAME,
    MAX_SEGMENTS,
    MAX_TENSORS,
    MAX_TEXT,
    MAX_TOKENS,
    PROTOCOL_VERSION,
    TICKET_BYTES,
    TOKEN_BYTES,
    TOKEN_TYPECODE,
    BlockHashes,
    BlockIds,
    Deadline,
    Extent,
    Name,
    NonNegative,
    Reply,
    Text,
    TokenIds,
    Wire,
    pack_tokens,
)

__all__ = [
    "CUDA_IPC_HANDLE_BYTES",
    "HASH_ALGOS",
    "KEPT_KEYS_BYTES",
    "MAX_BLOCK_IDS",
    "MAX_DIMS",
    "MAX_EXTENT",
    "MAX_GROUPS",
    "MAX_HASH_BYTES",
    "MAX_MM_ITEMS",
    "MAX_NAME",
    "MAX_SEGMENTS",
    "MAX_TENSORS",
    "MAX_TEXT",
    "MAX_TOKENS",
    "PROTOCOL_VERSION",
    "SIDECAR_HASH_ALGO",
    "TICKET_BYTES",
    "TOKEN_BYTES",
    "TOKEN_TYPECODE",
    "BlockHashes",
    "BlockIds",
    "BlockReport",
    "BlockWhy",
    "Cancel",
    "Cancelled",
    "CudaIpc",
    "CudaIpcEvent",
    "Deadline",
    "EngineMessage",
    "ErrorCode",
    "ErrorReply",
    "Explain",
    "Extent",
    "Handover",
    "HandoverTicket",
    "HashSelfTest",
    "Heartbeat",
    "HeartbeatAck",
    "IpcHandleBytes",
    "Load",
    "LoadDone",
    "Lookup",
    "LookupReply",
    "Name",
    "NonNegative",
    "Register",
    "Registered",
    "Reply",
    "Reports",
    "RequestKeys",
    "Save",
    "SaveDone",
    "SidecarMessage",
    "TensorHandle",
    "Text",
    "TokenIds",
    "Unregister",
    "Unregistered",
    "Wire",
    "compact_keys",
    "decode_engine_message",
    "decode_sidecar_message",
    "encode",
    "keys_size",
    "outcome_counts",
    "pack_tokens",
    "prompt_length",
]


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
