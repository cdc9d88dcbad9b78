"""Wire messages: every message round-trips, and every bad frame is a ProtocolError."""

from __future__ import annotations

import array
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.errors import ProtocolError
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import (
    MAX_TOKENS,
    TICKET_BYTES,
    BlockReport,
    BlockWhy,
    Cancel,
    Cancelled,
    EngineMessage,
    ErrorCode,
    ErrorReply,
    Explain,
    Handover,
    HandoverTicket,
    HashSelfTest,
    Heartbeat,
    HeartbeatAck,
    Load,
    LoadDone,
    Lookup,
    LookupReply,
    Register,
    Registered,
    RequestKeys,
    Save,
    SaveDone,
    SidecarMessage,
    TensorHandle,
    Unregister,
    Unregistered,
    decode_engine_message,
    decode_sidecar_message,
    encode,
    pack_tokens,
)
from pipeline.core.outcomes import BlockStatus

MAX = 1 << 20
_raw = msgspec.msgpack.Encoder()

KEYS = RequestKeys(lora_name="l", lora_path="/p", cache_salt="s", mm_items=(("img", 3, 5),))

ENGINE_MESSAGES: list[Any] = [
    Register(
        engine_id="engine-0",
        layout=KVCacheLayout.from_dict({
            "groups": [{"kind": "full_attention", "block_size": 16, "layers": ["a"]}],
            "model": "m",
        }),
        tensors=(
            TensorHandle(
                "a", 128, (2, 8, 16, 4), (512, 64, 4, 1), "bfloat16", block_dim=1, segment=0
            ),
        ),
        self_test=HashSelfTest((1, 2, 3), (b"\x00" * 32,)),
        hash_seed="42",
        handover=b"\x07" * TICKET_BYTES,
    ),
    Handover(seq=6),
    Heartbeat(seq=7),
    Lookup(seq=1, token_ids=pack_tokens((1, 2, 3)), keys=KEYS),
    Save(
        seq=2, request_id="r", token_ids=pack_tokens((1, 2, 2**32 - 1, 0)),
        block_ids=((1, 2), (0,), (3,)),
    ),
    Load(
        seq=3, request_id="r", token_ids=pack_tokens((1, 2, 3, 4)), block_ids=((4, 5),),
        num_tokens=4, keys=KEYS, deadline=1234.5,
    ),
    Cancel(seq=8, request_seq=3),
    Unregister(seq=9),
    Explain(seq=5, engine_id="engine-0", block_hashes=(b"\x01" * 32,)),
]

SIDECAR_MESSAGES: list[Any] = [
    Registered("engine-0", 16, 32, (0, 2), "abcd", 128),
    HandoverTicket(seq=6, token=b"\x07" * TICKET_BYTES, path="/run/kvsidecar/handover"),
    HeartbeatAck(seq=7),
    LookupReply(seq=1, hit_tokens=32),
    LookupReply(seq=5, hit_tokens=0, explain=(
        BlockWhy(0, 0, b"\x01" * 32, "evicted", "evicted to make room", 1.5),)),
    SaveDone(
        2,
        "r",
        (
            BlockReport(0, 0, 1, BlockStatus.STORED),
            BlockReport(2, 1, 3, BlockStatus.SKIPPED, "incomplete_block"),
        ),
    ),
    LoadDone(
        3,
        "r",
        16,
        (5,),
        (
            BlockReport(0, 0, 4, BlockStatus.LOADED),
            BlockReport(0, 1, 5, BlockStatus.FAILED, "missing"),
        ),
    ),
    Cancelled(seq=8, request_seq=3, epoch=77),
    Unregistered(seq=9),
    ErrorReply(ErrorCode.BAD_FRAME, "nope", seq=4),
]


def register_frame(layout: Any) -> bytes:
    return _raw.encode(
        {
            "kind": "register",
            "engine_id": "e",
            "layout": layout,
            "tensors": [],
            "self_test": {"token_ids": [], "block_hashes": []},
        }
    )


def reject(frame: bytes, max_bytes: int = MAX) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_engine_message(frame, max_bytes=max_bytes)
    return str(info.value)


# -- round trips ---------------------------------------------------------------------------


def test_every_message_kind_has_an_example() -> None:
    """The examples below cover every member of both tagged unions."""
    assert {type(m) for m in ENGINE_MESSAGES} == set(typing.get_args(EngineMessage))
    assert {type(m) for m in SIDECAR_MESSAGES} == set(typing.get_args(SidecarMessage))


@pytest.mark.parametrize("message", ENGINE_MESSAGES, ids=lambda m: type(m).__name__)
def test_engine_messages_round_trip(message: Any) -> None:
    """An engine message decodes to an equal message."""
    assert decode_engine_message(encode(message), max_bytes=MAX) == message


def test_token_ids_travel_as_little_endian_uint32() -> None:
    """Token ids are one binary field: 4 little-endian bytes per token."""
    frame = encode(Lookup(seq=1, token_ids=pack_tokens((1, 258, 2**32 - 1))))
    fields = msgspec.msgpack.decode(frame)
    assert fields["token_ids"] == b"\x01\x00\x00\x00\x02\x01\x00\x00\xff\xff\xff\xff"


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"]])
def test_token_ids_outside_uint32_are_refused_before_sending(bad: list[Any]) -> None:
    """A token id that does not fit the wire format is a clear error at the client."""
    with pytest.raises(ValueError, match="token ids must be integers"):
        pack_tokens(bad)


@pytest.mark.parametrize("message", SIDECAR_MESSAGES, ids=lambda m: type(m).__name__)
def test_sidecar_messages_round_trip(message: Any) -> None:
    """A sidecar message decodes to an equal message."""
    assert decode_sidecar_message(encode(message)) == message


# -- bad frames ----------------------------------------------------------------------------


def test_oversized_frame_is_rejected_before_decoding() -> None:
    """A frame over max_bytes is refused with its size and the limit, even if well formed."""
    frame = encode(Heartbeat(seq=1))
    assert decode_engine_message(frame, max_bytes=len(frame)) == Heartbeat(seq=1)
    message = reject(frame, max_bytes=len(frame) - 1)
    assert "exceeds" in message and str(len(frame)) in message


def test_truncated_frame_is_a_protocol_error() -> None:
    """Cutting a valid frame short names the truncation."""
    frame = encode(ENGINE_MESSAGES[3])
    assert "truncated" in reject(frame[:-3])


@pytest.mark.parametrize("frame", [b"\xc1", b"\x00\x01", b"", b"\xff\xff"])
def test_garbage_is_a_protocol_error(frame: bytes) -> None:
    """Bytes that are not one msgpack message are refused as malformed."""
    assert "malformed engine message" in reject(frame)


@pytest.mark.parametrize("kind", ["explode", "registered", "load_done"])
def test_unknown_kind_names_the_kind(kind: str) -> None:
    """A kind the engine may not send (unknown, or a sidecar reply) is refused by name."""
    message = reject(_raw.encode({"kind": kind, "seq": 1}))
    assert repr(kind) in message and "$.kind" in message


def test_missing_kind_is_a_protocol_error() -> None:
    """A map without a kind tag is refused."""
    assert "kind" in reject(_raw.encode({"seq": 1}))


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"kind": "heartbeat", "seq": "one"}, "$.seq"),
        ({"kind": "heartbeat", "seq": -1}, "$.seq"),
        ({"kind": "lookup", "seq": 1, "token_ids": [1, 2]}, "$.token_ids"),
        ({"kind": "lookup", "seq": 1, "token_ids": b"\x01\x00\x00"}, "$.token_ids"),
        (
            {"kind": "save", "seq": 1, "request_id": "r", "token_ids": b"", "block_ids": [[1, -2]]},
            "$.block_ids[0][1]",
        ),
        (
            {
                "kind": "load",
                "seq": 1,
                "request_id": 5,
                "token_ids": b"",
                "block_ids": [],
                "num_tokens": 0,
            },
            "$.request_id",
        ),
    ],
)
def test_wrong_types_name_the_field(fields: dict[str, Any], path: str) -> None:
    """A field of the wrong type or out of range is refused with its path."""
    assert f"`{path}`" in reject(_raw.encode(fields))


def test_unknown_fields_are_refused() -> None:
    """A field the protocol does not define is refused by name."""
    assert "`bogus`" in reject(_raw.encode({"kind": "heartbeat", "seq": 1, "bogus": 2}))


def test_missing_required_field_is_named() -> None:
    """A message without a required field is refused naming that field."""
    assert "`request_id`" in reject(
        _raw.encode({"kind": "save", "seq": 1, "token_ids": b"", "block_ids": []})
    )


def test_deeply_nested_frame_is_a_protocol_error() -> None:
    """A small frame nested past the recursion limit is malformed, not a crash."""
    frame = register_frame(msgspec.Raw(b"\x91" * 5000 + b"\x00"))
    assert len(frame) < 10_000
    assert "invalid KV-cache layout" in reject(frame)
    frame = _raw.encode({"kind": "heartbeat", "seq": msgspec.Raw(b"\x91" * 5000 + b"\x00")})
    assert "malformed engine message" in reject(frame)
    with pytest.raises(ProtocolError):
        decode_sidecar_message(
            _raw.encode(
                {"kind": "error", "code": "x", "message": msgspec.Raw(b"\x91" * 5000 + b"\x00")}
            )
        )


def test_sidecar_garbage_is_a_protocol_error() -> None:
    """The engine-side decoder refuses garbage and engine messages alike."""
    with pytest.raises(ProtocolError, match="malformed sidecar message"):
        decode_sidecar_message(b"\xc1")
    with pytest.raises(ProtocolError, match="'heartbeat'"):
        decode_sidecar_message(encode(Heartbeat(seq=1)))


# -- properties ----------------------------------------------------------------------------


def decode_or_protocol_error(frame: bytes) -> None:
    try:
        message = decode_engine_message(frame, max_bytes=MAX)
    except ProtocolError:
        return
    assert isinstance(message, typing.get_args(EngineMessage))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_protocol_error(frame: bytes) -> None:
    """Arbitrary bytes decode to a message or raise ProtocolError, nothing else."""
    decode_or_protocol_error(frame)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
KINDS = ["register", "heartbeat", "lookup", "save", "load", "unregister", "error", "x"]
FIELDS = [
    "seq",
    "engine_id",
    "layout",
    "tensors",
    "self_test",
    "hash_seed",
    "version",
    "token_ids",
    "keys",
    "request_id",
    "block_ids",
    "num_tokens",
]


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    fields=st.dictionaries(st.sampled_from(FIELDS), msgpack_values, max_size=6),
    cut=st.integers(0, 8),
)
def test_structured_garbage_only_ever_raises_protocol_error(
    kind: str, fields: dict[str, Any], cut: int
) -> None:
    """Well-formed msgpack with a plausible kind and random fields never escapes decoding."""
    frame = _raw.encode({"kind": kind, **fields})
    decode_or_protocol_error(frame)
    decode_or_protocol_error(frame[: len(frame) - cut])


# -- bounds ------------------------------------------------------------------------------


def _unbounded(annotation: Any, path: str, seen: set[type]) -> list[str]:
    """Paths of ``str``, ``bytes``, tuple and dict fields without a schema maximum under
    ``annotation``, walked through structs, unions and containers."""
    info = msgspec.inspect.type_info(annotation)
    return _walk(info, path, seen)


def _walk(info: msgspec.inspect.Type, path: str, seen: set[type]) -> list[str]:
    found: list[str] = []
    if isinstance(info, msgspec.inspect.StructType):
        if info.cls in seen:
            return []
        seen.add(info.cls)
        for field in info.fields:
            found += _walk(field.type, f"{info.cls.__name__}.{field.name}", seen)
    elif isinstance(info, msgspec.inspect.UnionType):
        for member in info.types:
            found += _walk(member, path, seen)
    elif isinstance(info, msgspec.inspect.StrType | msgspec.inspect.BytesType):
        if info.max_length is None:
            found.append(path)
    elif isinstance(info, msgspec.inspect.VarTupleType | msgspec.inspect.ListType
                    | msgspec.inspect.SetType | msgspec.inspect.FrozenSetType):
        if info.max_length is None:
            found.append(path)
        found += _walk(info.item_type, f"{path}[]", seen)
    elif isinstance(info, msgspec.inspect.TupleType):
        for index, item in enumerate(info.item_types):
            found += _walk(item, f"{path}[{index}]", seen)
    elif isinstance(info, msgspec.inspect.DictType):
        if info.max_length is None:
            found.append(path)
        found += _walk(info.key_type, f"{path}{{}}", seen)
        found += _walk(info.value_type, f"{path}{{}}", seen)
    elif isinstance(info, msgspec.inspect.AnyType):
        found.append(f"{path} (Any)")
    elif isinstance(info, msgspec.inspect.CustomType):
        # Token ids: bounded by the decoder's hook (checked below).
        if info.cls is not array.array:
            found.append(f"{path} ({info.cls.__name__})")
    return found


@pytest.mark.parametrize("union", [EngineMessage, SidecarMessage],
                         ids=["engine", "sidecar"])
def test_every_field_on_the_wire_has_a_schema_maximum(union: Any) -> None:
    """Every str, bytes, tuple and dict of every message type is bounded where it is
    decoded, so no frame costs more than a small multiple of its bytes."""
    assert _unbounded(union, "", set()) == []


def test_the_walk_finds_an_unbounded_field() -> None:
    """The bounds walk is not vacuous: it names a field without a maximum."""
    class Loose(msgspec.Struct):
        name: str
        items: tuple[int, ...]
        extra: dict[str, Any]

    assert _unbounded(Loose, "", set()) == [
        "Loose.name", "Loose.items", "Loose.extra", "Loose.extra{}", "Loose.extra{} (Any)"]


def test_token_ids_past_the_protocol_maximum_are_refused() -> None:
    """Token ids are decoded through a hook that refuses more than ``MAX_TOKENS``."""
    frame = _raw.encode({"kind": "lookup", "seq": 1,
                         "token_ids": b"\x00" * (4 * (MAX_TOKENS + 1))})
    assert "exceed the protocol" in reject(frame, max_bytes=1 << 30)


def test_strides_that_overflow_int64_do_not_decode() -> None:
    """A handle whose stride would overflow int64 arithmetic is a bad frame."""
    handle = {"layer": "a", "offset": 0, "shape": [16, 4096, 1],
              "strides": [4096, 1, 2**64 - 1], "dtype": "bfloat16"}
    frame = _raw.encode({"kind": "register", "engine_id": "e", "layout": {
        "groups": [{"kind": "full_attention", "block_size": 16, "layers": ["a"]}]},
        "tensors": [handle], "self_test": {"token_ids": [], "block_hashes": []}})
    assert "strides" in reject(frame)
