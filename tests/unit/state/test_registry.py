"""Registration: fail closed on bad layouts, hash mismatches and missing tensors; map only
the stored groups' tensors; re-registration replaces the session and releases its mappings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import pytest
import torch

from pipeline.core.config import LimitsConfig, TenantConfig
from pipeline.core.errors import LimitExceeded, ProtocolError, RequestRejected, TransportError
from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.hashing import block_hashes
from pipeline.core.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    HashSelfTest,
    Register,
    Save,
    TensorHandle,
    decode_engine_message,
    encode,
    pack_tokens,
)
from pipeline.core.tenancy import Peer, Tenancy
from pipeline.state.jobs import Job, JobTracker
from pipeline.state.registry import LayerTensors, MappingBudget, SessionRegistry

NUM_BLOCKS = 8
SELF_TEST_TOKENS = tuple(range(1000, 1008))
"""Two hash blocks of 4, the most a self-test may carry."""


def full(block_size: int, *layers: str, **extra: Any) -> dict[str, Any]:
    return {"kind": "full_attention", "block_size": block_size, "layers": list(layers), **extra}


def ring(capacity: int, *layers: str) -> dict[str, Any]:
    return {"kind": "circular_buffer", "block_size": capacity, "layers": list(layers)}


def mamba(block_size: int, mode: str, *layers: str) -> dict[str, Any]:
    return {
        "kind": "mamba",
        "block_size": block_size,
        "mamba_cache_mode": mode,
        "layers": list(layers),
    }


HYBRID = {
    "model": "m",
    "groups": [
        full(4, "attn.0", "attn.1"),
        ring(4, "ring.0", "ring.1"),
        mamba(4, "align", "ssm.0"),
    ],
}


def handle(layer: str) -> TensorHandle:
    """Attention-style K/V-first [2, N, 4, 2] float32 handles; one name per layer."""
    return TensorHandle(
        layer, 0, (2, NUM_BLOCKS, 4, 2), (64, 8, 2, 1), "float32", block_dim=1, segment=0
    )


def layers_of(layout: dict[str, Any]) -> list[str]:
    return [layer for group in layout["groups"] for layer in group.get("layers", ())]


def register(
    layout: dict[str, Any] = HYBRID,
    *,
    hash_block_size: int = 4,
    tensors: Sequence[TensorHandle] | None = None,
    hash_seed: str | None = None,
    self_test_seed: str | None = None,
    version: int = PROTOCOL_VERSION,
    engine_id: str = "engine-0",
) -> Register:
    """A Register whose self-test hashes are right unless told otherwise, as the sidecar
    decodes it (with its layout as sent where that does not decode)."""
    hashes = block_hashes(SELF_TEST_TOKENS, hash_block_size, seed=self_test_seed or hash_seed)
    message = Register(
        engine_id=engine_id,
        layout=layout,  # type: ignore[arg-type]  # a dict: the wire's form of a layout
        tensors=tuple(tensors if tensors is not None else map(handle, layers_of(layout))),
        self_test=HashSelfTest(SELF_TEST_TOKENS, tuple(hashes)),
        hash_seed=hash_seed,
        version=version,
    )
    try:
        return wire(message)
    except ProtocolError:
        return message


def wire(message: Register) -> Register:
    """``message`` as the sidecar receives it."""
    decoded = decode_engine_message(encode(message), max_bytes=1 << 24)
    assert isinstance(decoded, Register)
    return decoded


class FakeMapping:
    """A mapping that records its release, of an owner that is alive until told."""

    def __init__(self, mapper: FakeMapper, index: int) -> None:
        self._mapper = mapper
        self._index = index
        self.exited = False

    def close(self) -> None:
        self._mapper.released.append(self._index)

    def owner_exited(self) -> bool:
        return self.exited

    @property
    def mapped_bytes(self) -> int:
        return self._mapper.mapped_bytes

    def lost(self) -> bool:
        return False


class FakeMapper:
    """A map_tensors that records the handles it is given and each mapping's release."""

    def __init__(self, *, fail: bool = False, mapped_bytes: int = 800) -> None:
        self.mapped_bytes = mapped_bytes
        """What each mapping reports having mapped."""
        self.calls: list[list[str]] = []
        self.budgets: list[MappingBudget] = []
        self.released: list[int] = []
        self.fail = fail

    def __call__(self, handles: Sequence[TensorHandle], budget: MappingBudget,
                 peer: Peer, handed: Any) -> tuple[LayerTensors, Any]:
        if self.fail:
            raise TransportError("shared memory /kv-attn.0 is gone")
        mapping = len(self.calls)
        self.calls.append([h.layer for h in handles])
        self.budgets.append(budget)
        tensors = {h.layer: (torch.zeros(h.shape), h.block_dim) for h in handles}
        return tensors, FakeMapping(self, mapping)

    @property
    def mapped_layers(self) -> set[str]:
        return {layer for call in self.calls for layer in call}


PEER = Peer("uid:0", pid=1, uid=0)
OTHER = Peer("uid:1000", pid=2, uid=1000)


def registry(mapper: FakeMapper, *, max_value_bytes: int = 1 << 20,
             prepare_copies: Callable[[Sequence[StoreGroupGeometry]], None] | None = None,
             limits: LimitsConfig | None = None) -> SessionRegistry:
    return SessionRegistry(
        mapper,
        max_value_bytes=max_value_bytes,
        save_capacity_blocks=lambda value_bytes: 4096 // value_bytes,
        prepare_copies=prepare_copies,
        limits=limits,
    )


async def rejected(reg: SessionRegistry, message: Register, code: str) -> str:
    """Why the sidecar refuses ``message``: when it decodes, or when it registers."""
    with pytest.raises((RequestRejected, ProtocolError)) as info:
        await reg.register(b"engine", PEER, wire(message))
    assert info.value.code == code
    return str(info.value)


# -- accepted registrations --------------------------------------------------------------------


async def test_registration_maps_only_the_stored_groups_layers() -> None:
    """The ring's handles are never given to map_tensors; stored layers all are."""
    mapper = FakeMapper()
    session, reply = await registry(mapper).register(b"engine", PEER, register())
    assert mapper.calls == [["attn.0", "attn.1", "ssm.0"]]
    assert not mapper.mapped_layers & {"ring.0", "ring.1"}
    assert [g.kv_group_id for g in session.store_groups] == [0, 2]
    assert reply.store_group_ids == (0, 2)
    assert (reply.hash_block_size, reply.lookup_alignment) == (4, 4)
    assert reply.layout_fingerprint == session.layout.fingerprint
    value_bytes = 2 * 2 * 4 * 2 * 4  # two layers, K and V, 4 tokens x 2 floats each
    assert session.store_groups[0].value_bytes == value_bytes
    # Each stored value carries its 8-byte checksum after the payload.
    assert session.store_groups[0].stored_bytes == value_bytes + 8
    assert reply.save_capacity_blocks == 4096 // (value_bytes + 8)


async def test_copies_are_prepared_for_each_engine_registered_with_tensors() -> None:
    """The copies are prepared (their GPU kernels compiled) with the store groups of each
    engine registered with tensors; never for a rejected registration or one that only
    looks up."""
    prepared: list[tuple[int, ...]] = []

    def prepare(groups: Sequence[StoreGroupGeometry]) -> None:
        prepared.append(tuple(g.kv_group_id for g in groups))

    # A value over the 100 bytes of a staging slot.
    await rejected(registry(FakeMapper(), max_value_bytes=100, prepare_copies=prepare), register(),
             "bad_tensors")
    reg = registry(FakeMapper(), prepare_copies=prepare)
    session, _ = await reg.register(b"engine", PEER, register())
    await reg.register(b"looker", PEER, msgspec.structs.replace(
        register(tensors=(), engine_id="looker"), lookup_only=True))
    assert prepared == [(0, 2)]
    assert [g.kv_group_id for g in session.store_groups] == [0, 2]


async def test_gpu_tensors_are_refused_by_a_sidecar_that_copies_with_threads() -> None:
    """A CPU sidecar refuses an engine whose stored layers are on a GPU, naming the
    layer and the setting, before mapping anything; a ring on a GPU alone is fine."""
    mapper = FakeMapper()
    on_gpu = [msgspec.structs.replace(handle(layer), device="cuda:0")
              if layer == "attn.1" else handle(layer) for layer in layers_of(HYBRID)]
    reason = await rejected(registry(mapper), register(tensors=on_gpu), "bad_tensors")
    assert "layer 'attn.1' is on cuda:0" in reason and "stages.transfer.device" in reason
    assert mapper.calls == []
    ring_on_gpu = [msgspec.structs.replace(handle(layer), device="cuda:0")
                   if layer.startswith("ring") else handle(layer) for layer in layers_of(HYBRID)]
    await registry(mapper).register(b"engine", PEER, register(tensors=ring_on_gpu))
    assert mapper.calls == [["attn.0", "attn.1", "ssm.0"]]


async def test_registration_accepts_a_seeded_self_test() -> None:
    """An engine with PYTHONHASHSEED hashes from that seed and is accepted."""
    session, _ = await registry(FakeMapper()).register(b"engine", PEER, register(hash_seed="1234"))
    assert session.hash_seed == "1234"


async def test_handles_of_unknown_layers_are_not_mapped() -> None:
    """A handle for a layer outside every stored group is ignored, never mapped."""
    mapper = FakeMapper()
    handles = [*map(handle, layers_of(HYBRID)), handle("stray.0")]
    await registry(mapper).register(b"engine", PEER, register(tensors=handles))
    assert "stray.0" not in mapper.mapped_layers


# -- rejections --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ({"model": "m", "groups": [ring(4, "ring.0")]}, "at least one prefix-cacheable"),
        ({"model": "m", "groups": [full(4, "a"), mamba(4, "all", "s")]}, "group 1"),
        ({"model": "m", "groups": [full(4, "a"), full(6, "b")], "prefix_match_unit": 4}, "group 1"),
        (
            {"model": "m", "groups": [{"kind": "cross_attention", "block_size": 4}]},
            "cannot be stored",
        ),
        ({"model": "m", "groups": [full(4, "a", bogus=1)]}, "bogus"),
        ({"model": "m", "groups": []}, "at least one kv-cache group"),
    ],
)
async def test_bad_layouts_are_rejected_before_any_mapping(
    layout: dict[str, Any], reason: str
) -> None:
    """A layout that cannot be stored is refused (bad_layout) naming why; nothing is mapped."""
    mapper = FakeMapper()
    reg = registry(mapper)
    assert reason in await rejected(reg, register(layout), ErrorCode.BAD_LAYOUT)
    assert mapper.calls == [] and reg.sessions == {}


@pytest.mark.parametrize(
    "message",
    [
        register(hash_block_size=8),  # the engine hashes in blocks of 8, the sidecar in 4
        register(hash_seed="1234", self_test_seed="vllm-none-hash"),  # seed ignored
        register(self_test_seed="other"),
    ],
    ids=["block-size", "seed-ignored", "other-seed"],
)
async def test_hash_self_test_mismatch_is_rejected_before_mapping(message: Register) -> None:
    """Hashes that differ from the sidecar's refuse the engine (hash_mismatch); nothing mapped."""
    mapper = FakeMapper()
    assert "hash_block_size=4" in await rejected(registry(mapper), message, ErrorCode.HASH_MISMATCH)
    assert mapper.calls == []


async def test_a_self_test_too_short_to_hash_is_rejected() -> None:
    """A self-test without one full hash block proves nothing and is refused."""
    message = Register(
        "e", HYBRID, tuple(map(handle, layers_of(HYBRID))), HashSelfTest((1, 2, 3), ())
    )
    await rejected(registry(FakeMapper()), message, ErrorCode.HASH_MISMATCH)


async def test_an_unsupported_protocol_version_is_rejected() -> None:
    """A Register of another protocol version is refused with bad_version."""
    assert str(PROTOCOL_VERSION) in await rejected(
        registry(FakeMapper()), register(version=PROTOCOL_VERSION + 1), ErrorCode.BAD_VERSION
    )


async def test_a_stored_layer_without_a_tensor_is_rejected_and_released() -> None:
    """A stored layer without a handle is refused (bad_tensors) naming it; mappings released."""
    mapper = FakeMapper()
    reg = registry(mapper)
    handles = [handle(layer) for layer in layers_of(HYBRID) if layer != "ssm.0"]
    message = await rejected(reg, register(tensors=handles), ErrorCode.BAD_TENSORS)
    assert "'ssm.0'" in message and "group 2" in message
    assert mapper.released == [0]
    assert reg.sessions == {}


async def test_a_value_larger_than_a_staging_slot_is_rejected_and_released() -> None:
    """A block that cannot fit one staging slot is refused; its mappings are released."""
    mapper = FakeMapper()
    message = await rejected(registry(mapper, max_value_bytes=64), register(),
                             ErrorCode.BAD_TENSORS)
    assert "staging.slot_bytes" in message
    assert mapper.released == [0]


async def test_a_mapping_failure_is_rejected() -> None:
    """A transport error while mapping becomes a bad_tensors rejection."""
    assert "is gone" in await rejected(registry(FakeMapper(fail=True)), register(),
                                       ErrorCode.BAD_TENSORS)


# -- re-registration and removal ---------------------------------------------------------------


async def test_reregistration_replaces_the_session_and_releases_its_mappings() -> None:
    """Registering the same identity again closes the old session and releases its mapping."""
    mapper = FakeMapper()
    reg = registry(mapper)
    old, _ = await reg.register(b"engine", PEER, register())
    new, _ = await reg.register(b"engine", PEER, register(engine_id="engine-0b"))
    assert new is not old and reg.get(b"engine", PEER) is new
    assert old.closed and not new.closed
    assert mapper.released == [0]
    reg.remove(b"engine")
    assert mapper.released == [0, 1]
    assert reg.get(b"engine", PEER) is None


async def test_a_failed_reregistration_keeps_the_old_session() -> None:
    """A rejected re-registration leaves the working session and its mapping alone."""
    mapper = FakeMapper()
    reg = registry(mapper)
    old, _ = await reg.register(b"engine", PEER, register())
    await rejected(reg, register(self_test_seed="other"), ErrorCode.HASH_MISMATCH)
    assert reg.get(b"engine", PEER) is old and not old.closed
    assert mapper.released == []


async def test_replaced_session_keeps_its_mapping_until_its_jobs_finish() -> None:
    """A replaced session with a job in flight is released only once that job is answered."""
    mapper = FakeMapper()
    reg = registry(mapper)
    old, _ = await reg.register(b"engine", PEER, register())
    send, _receive = anyio.create_memory_object_stream[Job](4)
    tracker = JobTracker(send)
    job = Job(old, Save(1, "r", pack_tokens((1, 2, 3, 4)), ((1,), (0,), (2,))))
    tracker.accept(job)
    await reg.register(b"engine", PEER, register())
    assert old.closed and mapper.released == []
    tracker.answered(job)
    assert mapper.released == [0]


async def test_sessions_of_other_engines_are_independent() -> None:
    """Two identities hold two sessions; closing the registry releases both."""
    mapper = FakeMapper()
    reg = registry(mapper)
    await reg.register(b"a", PEER, register())
    await reg.register(b"b", OTHER, register())
    assert set(reg.sessions) == {b"a", b"b"} and mapper.released == []
    reg.close()
    assert sorted(mapper.released) == [0, 1] and reg.sessions == {}


# -- limits ------------------------------------------------------------------------------------


async def test_a_self_test_longer_than_two_hash_blocks_is_refused_unhashed() -> None:
    """A self-test of more than two hash blocks is refused before it is hashed; nothing is
    mapped."""
    tokens = tuple(range(1000, 1012))
    message = msgspec.structs.replace(
        register(), self_test=HashSelfTest(tokens, tuple(block_hashes(tokens, 4))))
    mapper = FakeMapper()
    assert "two hash blocks" in await rejected(registry(mapper), message,
                                               ErrorCode.HASH_MISMATCH)
    assert mapper.calls == []


async def test_registrations_past_max_engines_are_refused_naming_the_limit() -> None:
    """Past ``limits.max_engines`` a new identity is refused (over_limit, the limit named);
    one already registered may register again."""
    reg = registry(FakeMapper(), limits=LimitsConfig(max_engines=1))
    await reg.register(b"a", PEER, register())
    with pytest.raises(LimitExceeded) as info:
        await reg.register(b"b", OTHER, register())
    assert info.value.code == ErrorCode.OVER_LIMIT
    assert "limits.max_engines" in str(info.value)
    await reg.register(b"a", PEER, register())
    assert set(reg.sessions) == {b"a"}


async def test_blocks_larger_than_max_block_tokens_are_refused() -> None:
    """A layout with a block past ``limits.max_block_tokens`` is refused before mapping."""
    mapper = FakeMapper()
    reg = registry(mapper, limits=LimitsConfig(max_block_tokens=2))
    with pytest.raises(LimitExceeded, match=r"limits\.max_block_tokens"):
        await reg.register(b"a", PEER, register())
    assert mapper.calls == []


async def test_each_registration_maps_within_what_the_others_leave() -> None:
    """The mapping budget is the engine's share, or what the other sessions' mappings
    leave of the total when that is less, naming the limit that binds."""
    mapper = FakeMapper()
    limits = LimitsConfig(engine_mapped_bytes=1000, total_mapped_bytes=1500)
    reg = registry(mapper, limits=limits)
    await reg.register(b"a", PEER, register())
    await reg.register(b"b", OTHER, register())
    await reg.register(b"a", PEER, register())  # its own old mapping does not count
    assert mapper.budgets == [MappingBudget(1000, "limits.engine_mapped_bytes"),
                              MappingBudget(700, "limits.total_mapped_bytes"),
                              MappingBudget(700, "limits.total_mapped_bytes")]


async def test_a_registration_failing_after_mapping_unmaps() -> None:
    """Whatever fails once the tensors are mapped (here, preparing the copies), the
    mapping is released and no session is left behind."""
    def prepare(groups: Sequence[StoreGroupGeometry]) -> None:
        raise RuntimeError("a bug")

    mapper = FakeMapper()
    reg = registry(mapper, prepare_copies=prepare)
    with pytest.raises(RuntimeError):
        await reg.register(b"a", PEER, register())
    assert mapper.released == [0] and reg.sessions == {}


# -- identities and tenants ------------------------------------------------------------------

TENANTS = Tenancy({"a": TenantConfig(identities=("uid:0",)),
                   "b": TenantConfig(identities=("uid:1000",), key_prefix="bee")},
                  ("uid:4242",))


def tenant_registry(mapper: FakeMapper) -> SessionRegistry:
    return SessionRegistry(mapper, max_value_bytes=1 << 20,
                           save_capacity_blocks=lambda value_bytes: 4096 // value_bytes,
                           tenancy=TENANTS)


async def test_a_tenants_key_prefix_is_forced_and_another_is_refused() -> None:
    """An engine of a tenant gets the tenant's key prefix whatever it left empty; naming
    another tenant's prefix is refused before anything is mapped."""
    mapper = FakeMapper()
    reg = tenant_registry(mapper)
    session, _ = await reg.register(b"b", OTHER, register())
    assert session.tenant == "b" and session.layout.cache_prefix == "bee"
    assert all(g.key_prefix.startswith("bee@") for g in session.store_groups)
    assert set(reg.value_sizes) == {"b"}
    with pytest.raises(RequestRejected) as refused:
        await reg.register(b"b2", OTHER, register({**HYBRID, "cache_prefix": "a"},
                                                  engine_id="poisoner"))
    assert refused.value.code == ErrorCode.BAD_LAYOUT and "not this tenant's" in str(
        refused.value)
    assert len(mapper.calls) == 1


async def test_a_session_answers_only_the_identity_that_registered_it() -> None:
    """Another identity on the same routing id finds no session; an engine id is its
    identity's own, and re-registering it from a new connection replaces the old one."""
    reg = tenant_registry(FakeMapper())
    mine, _ = await reg.register(b"conn", PEER, register(engine_id="e"))
    assert reg.get(b"conn", PEER) is mine and reg.get(b"conn", OTHER) is None
    theirs, _ = await reg.register(b"other", OTHER, register(engine_id="e"))
    assert not mine.closed and reg.get(b"other", OTHER) is theirs
    resumed, _ = await reg.register(b"reconnected", PEER, register(engine_id="e"))
    assert mine.closed and not theirs.closed
    assert set(reg.sessions) == {b"other", b"reconnected"} and resumed.engine_id == "e"


async def test_explain_finds_engines_of_the_callers_tenant_only() -> None:
    """An engine id of another tenant is not found (and not named); an operator finds
    any engine."""
    reg = tenant_registry(FakeMapper())
    await reg.register(b"a", PEER, register(engine_id="a-engine"))
    await reg.register(b"b", OTHER, register(engine_id="b-engine"))
    assert reg.find("b-engine", OTHER).engine_id == "b-engine"
    assert reg.find("", OTHER).engine_id == "b-engine"
    for engine_id, asker in (("a-engine", OTHER), ("", Peer("uid:7"))):
        with pytest.raises(RequestRejected) as refused:
            reg.find(engine_id, asker)
        assert "a-engine" not in str(refused.value) and "b-engine" not in str(refused.value)
    assert reg.find("a-engine", Peer("uid:4242")).engine_id == "a-engine"
