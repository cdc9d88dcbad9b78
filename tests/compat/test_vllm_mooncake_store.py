"""One Mooncake cluster shared with vLLM 0.33's own MooncakeStoreConnector.

vLLM's side is its own code: ``RankLocalStoreLayout`` / ``ChunkedTokenDatabase`` build
the keys and the value regions from the engine's KV tensors, and the Mooncake client
calls vLLM makes (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``)
move the bytes through a real ``mooncake_master`` on loopback. kvsidecar's side is a
sidecar process with ``store.value_format: vllm`` and engines sharing their tensors.
"""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest
import pytest_asyncio
import torch

from pipeline.backends.stores.mooncake.master import EmbeddedMaster, open_embedded_master
from pipeline.backends.stores.mooncake.setup import open_mooncake_store
from pipeline.backends.stores.mooncake.store import MooncakeStore
from pipeline.core.config import MooncakeStoreConfig
from pipeline.core.geometry import build_store_groups
from pipeline.core.hashing import block_hashes
from pipeline.core.keys import ValueFormat
from pipeline.core.layout import KVCacheLayout
from pipeline.testing import run_sidecar_process
from tests.kit import random_tokens
from transport.client import EngineClient
from transport.tensors import shared_kv_tensor

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data")
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    RankLocalStoreLayout,
)
from vllm.v1.core.kv_cache_utils import BlockHash

pytestmark = pytest.mark.mooncake

MIB = 1 << 20
TIMEOUT = 60
NUM_BLOCKS = 16
BLOCK = 16  # tokens per block
HEADS, HEAD_DIM = 2, 32  # per TP rank, bfloat16
Alloc = Callable[[tuple[int, ...]], torch.Tensor]


def private(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bfloat16)


def shared(shape: tuple[int, ...]) -> torch.Tensor:
    return shared_kv_tensor(shape, torch.bfloat16)


# -- engine memory, laid out as vLLM lays it out ------------------------------------------


def dense_caches(alloc: Alloc, layers: int = 3) -> dict[str, torch.Tensor]:
    """One blocks-first [B, H, N, D] tensor per layer, each its own storage."""
    return {f"attn.{i}": alloc((NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM)) for i in range(layers)}


def hybrid_caches(alloc: Alloc, layers: int = 2) -> dict[str, torch.Tensor]:
    """The QSA hybrid as vLLM allocates it: attention layer i and Mamba layer i overlay
    one buffer (one page per block, shared by the two groups); the ring has its own."""
    caches: dict[str, torch.Tensor] = {}
    for i in range(layers):
        buffer = alloc((NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM))
        caches[f"attn.{i}"] = buffer
        caches[f"ring.{i}"] = alloc((NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM))
        caches[f"mamba.{i}"] = buffer.view(NUM_BLOCKS, -1)  # the state, in the same page
    return caches


PAGE = HEADS * BLOCK * HEAD_DIM * 2


def dense_layout(tp_rank: int, tp_size: int) -> dict[str, Any]:
    return {
        "model": "tiny-gqa", "tp_rank": tp_rank, "tp_size": tp_size, "num_kv_heads": 4,
        "groups": [{"kind": "full_attention", "block_size": BLOCK, "page_bytes": PAGE,
                    "layers": [f"attn.{i}" for i in range(3)]}],
    }


def hybrid_layout() -> dict[str, Any]:
    layers = range(2)
    return {
        "model": "tiny-qsa", "num_kv_heads": HEADS,
        "groups": [
            {"kind": "full_attention", "block_size": BLOCK, "page_bytes": PAGE,
             "layers": [f"attn.{i}" for i in layers]},
            {"kind": "circular_buffer", "block_size": 4, "page_bytes": PAGE,
             "layers": [f"ring.{i}" for i in layers]},
            {"kind": "mamba", "block_size": BLOCK, "mamba_cache_mode": "align",
             "page_bytes": PAGE, "layers": [f"mamba.{i}" for i in layers]},
        ],
    }


def fill(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for tensor in caches.values():
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8).set_(storage)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def stored_layers(layout: KVCacheLayout, caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What vLLM's worker hands its store layout: the stored groups' layers, in order."""
    stored = {layer for layers in layout.payload_layers for layer in layers}
    return [tensor for layer, tensor in caches.items() if layer in stored]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes seen as bfloat16 include NaNs, never equal)."""
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def read(addresses: list[int], sizes: list[int]) -> bytes:
    return b"".join(ctypes.string_at(a, s) for a, s in zip(addresses, sizes, strict=True))


class VllmSide:
    """vLLM's MooncakeStore worker for one rank: its layout and key code over its own KV
    memory, and its Mooncake client calls."""

    def __init__(self, client: Any, layout: KVCacheLayout, caches: dict[str, torch.Tensor]):
        self.client, self.layout, self.caches = client, layout, caches
        self.dbs = []
        tensors = stored_layers(layout, caches)
        for index, kv_group_id in enumerate(layout.prefix_cacheable_group_ids):
            factor = 1 if layout.groups[kv_group_id].kind == "mamba" else max(
                1, layout.tp_size // layout.num_kv_heads)
            metadata = KeyMetadata(model_name=layout.model, tp_rank=layout.tp_rank // factor,
                                   pcp_rank=0, dcp_rank=0, pp_rank=0, group_id=index)
            store_layout = RankLocalStoreLayout(metadata, BLOCK, BLOCK)
            store_layout.register_kv_caches(tensors, NUM_BLOCKS)
            self.dbs.append(ChunkedTokenDatabase(metadata, BLOCK, BLOCK, store_layout))
        self.registered: list[int] = []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.registered:
                assert client.register_buffer(storage.data_ptr(), storage.nbytes()) == 0
                self.registered.append(storage.data_ptr())

    def close(self) -> None:
        for address in self.registered:
            self.client.unregister_buffer(address)

    def batch(self, store_group: int, tokens: list[int], block_ids: list[int]) -> tuple[
            list[str], list[list[int]], list[list[int]]]:
        db = self.dbs[store_group]
        hashes = [BlockHash(h) for h in block_hashes(tokens, BLOCK)]
        keys, addrs, sizes = [], [], []
        for (start, _, chunk_hash), block_id in zip(
                db.process_tokens(len(hashes) * BLOCK, hashes), block_ids, strict=True):
            assert start % BLOCK == 0
            if block_id == 0:  # the null block: a group that needs no state there
                continue
            address, size = db.prepare_value_for_block(block_id)
            keys.append(db.key_for(chunk_hash))
            addrs.append(address)
            sizes.append(size)
        return keys, addrs, sizes

    def put(self, store_group: int, tokens: list[int], block_ids: list[int]) -> list[int]:
        from mooncake.store import ReplicateConfig

        keys, addrs, sizes = self.batch(store_group, tokens, block_ids)
        result: list[int] = self.client.batch_put_from_multi_buffers(
            keys, addrs, sizes, ReplicateConfig())
        return result

    def get(self, store_group: int, tokens: list[int], block_ids: list[int]) -> list[int]:
        keys, addrs, sizes = self.batch(store_group, tokens, block_ids)
        result: list[int] = self.client.batch_get_into_multi_buffers(keys, addrs, sizes)
        return result


# -- the value format, in process -------------------------------------------------------------


@pytest.mark.parametrize("shape", ["dense", "hybrid", "padded", "head_outer"])
def test_vllm_format_values_are_vllm_store_layout_bytes(shape: str) -> None:
    """For every block, kvsidecar's vllm-format value is byte for byte what vLLM's
    RankLocalStoreLayout puts under the key: overlaid groups, padding between blocks and
    per-head regions of head-outer tensors included."""
    if shape == "hybrid":
        layout, caches = KVCacheLayout.from_dict(hybrid_layout()), hybrid_caches(private)
    else:
        layout = KVCacheLayout.from_dict(dense_layout(0, 1))
        if shape == "dense":
            caches = dense_caches(private)
        elif shape == "padded":  # each block followed by unused bytes
            caches = {f"attn.{i}": private((NUM_BLOCKS, HEADS + 1, BLOCK, HEAD_DIM))[:, :HEADS]
                      for i in range(3)}
        else:  # heads outermost in memory: [H, B, N, D] seen as [B, H, N, D]
            caches = {f"attn.{i}": private((HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)).transpose(0, 1)
                      for i in range(3)}
    fill(caches, seed=1)
    ours = build_store_groups(
        layout, {layer: (tensor, 0) for layer, tensor in caches.items()
                 if any(layer in g for g in layout.payload_layers)},
        value_format=ValueFormat.VLLM,
    )
    tensors = stored_layers(layout, caches)
    for index, geometry in enumerate(ours):
        theirs = RankLocalStoreLayout(KeyMetadata("m", 0, 0, 0, 0, index), BLOCK, BLOCK)
        theirs.register_kv_caches(tensors, NUM_BLOCKS)
        assert geometry.value_bytes == sum(theirs.block_len)
        assert geometry.checksum_seed is not None  # kept beside the value, not in it
        for block_id in (1, 7, NUM_BLOCKS - 1):
            value = torch.cat([s.blocks[block_id] for s in geometry.segments])
            assert value.numpy().tobytes() == read(*theirs.prepare_value_for_block(block_id))


# -- through one Mooncake cluster ---------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def master() -> AsyncIterator[EmbeddedMaster]:
    with anyio.fail_after(30):
        started = await open_embedded_master(MooncakeStoreConfig())
    async with started:
        yield started


def cluster(master: EmbeddedMaster) -> dict[str, Any]:
    return {"master": master.endpoints.master_address,
            "metadata_server": master.endpoints.metadata_server,
            "global_segment_bytes": 64 * MIB, "local_buffer_bytes": 16 * MIB}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def vllm_client(master: EmbeddedMaster) -> AsyncIterator[MooncakeStore]:
    """A Mooncake client in this process, as vLLM's worker holds one."""
    store = await open_mooncake_store(MooncakeStoreConfig(**cluster(master)))
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def vllm_sides(vllm_client: MooncakeStore) -> Iterator[Callable[..., VllmSide]]:
    """vLLM workers over the one client; their memory is unregistered afterwards."""
    made: list[VllmSide] = []

    def make(layout: dict[str, Any], caches: dict[str, torch.Tensor]) -> VllmSide:
        made.append(VllmSide(vllm_client.raw_client, KVCacheLayout.from_dict(layout), caches))
        return made[-1]

    yield make
    for side in made:
        side.close()


def sidecar_config(master: EmbeddedMaster, **store: Any) -> dict[str, Any]:
    return {"store": {"backend": "mooncake", "value_format": "vllm", "mooncake": cluster(master),
                      **store},
            "staging": {"pool_bytes": 16 * MIB, "slot_bytes": 1 * MIB, "load_slots": 4}}


async def connect(endpoint: str, layout: dict[str, Any],
                  caches: dict[str, torch.Tensor]) -> EngineClient:
    return await EngineClient.connect(endpoint, layout=KVCacheLayout.from_dict(layout),
                                      kv_caches=caches)


@pytest.mark.asyncio(loop_scope="module")
async def test_dense_gqa_at_tp2_vllm_writes_and_kvsidecar_loads_byte_exact(
    master: EmbeddedMaster, vllm_sides: Callable[..., VllmSide],
) -> None:
    """vLLM's two TP ranks put a prefix; a kvsidecar engine of the same two ranks finds
    it (both rank namespaces hold it) and loads each rank's blocks byte for byte. With
    only rank 0's keys there, the lookup is a miss."""
    tokens = random_tokens(4 * BLOCK + 3, seed=7)
    ranks = [dense_layout(r, 2) for r in (0, 1)]
    theirs = []
    for rank, layout in enumerate(ranks):
        caches = dense_caches(private)
        fill(caches, seed=10 + rank)
        theirs.append(vllm_sides(layout, caches))
    ours = [dense_caches(shared) for _ in ranks]
    with run_sidecar_process(sidecar_config(master, verify="if_present")) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await connect(sidecar.endpoint, ranks[0], ours[0]) as rank0, \
                    await connect(sidecar.endpoint, ranks[1], ours[1]) as rank1:
                put0 = await anyio.to_thread.run_sync(theirs[0].put, 0, tokens, [1, 2, 3, 4])
                half_hit = await rank0.lookup(tokens)
                put1 = await anyio.to_thread.run_sync(theirs[1].put, 0, tokens, [1, 2, 3, 4])
                hit = await rank0.lookup(tokens)
                loads = [await client.load(f"r{i}", tokens, [[5, 6, 7, 8]], hit)
                         for i, client in enumerate((rank0, rank1))]
    assert put0 == put1 == [0, 0, 0, 0]
    assert half_hit == 0 and hit == 4 * BLOCK
    for vllm_side, caches, load in zip(theirs, ours, loads, strict=True):
        assert load.loaded_tokens == hit and not load.invalid_block_ids
        for j in range(4):
            assert all(same(vllm_side.caches[layer][1 + j], caches[layer][5 + j])
                       for layer in caches)


@pytest.mark.asyncio(loop_scope="module")
async def test_qsa_hybrid_kvsidecar_saves_and_vllm_loads_byte_exact(
    master: EmbeddedMaster, vllm_sides: Callable[..., VllmSide],
) -> None:
    """A kvsidecar engine saves the QSA hybrid (full + ring + Mamba align); vLLM's code
    gets every stored group's keys into its own memory, byte for byte. Then vLLM puts
    another prefix and a kvsidecar engine loads it. The ring is never stored by either."""
    layout = hybrid_layout()
    tokens = random_tokens(3 * BLOCK + 5, seed=8)
    engine = hybrid_caches(shared)
    fill(engine, seed=20)
    vllm = vllm_sides(layout, hybrid_caches(private))
    other = random_tokens(2 * BLOCK + 1, seed=12)
    with run_sidecar_process(sidecar_config(master, verify="if_present")) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await connect(sidecar.endpoint, layout, engine) as client:
                saved = await client.save("s", tokens, [[1, 2, 3], [9], [0, 0, 3]])
                got = [await anyio.to_thread.run_sync(vllm.get, 0, tokens, [4, 5, 6]),
                       await anyio.to_thread.run_sync(vllm.get, 1, tokens, [0, 0, 13])]
                received = {layer: t.clone() for layer, t in vllm.caches.items()}
                fill(vllm.caches, seed=21)
                put = [await anyio.to_thread.run_sync(vllm.put, 0, other, [7, 8]),
                       await anyio.to_thread.run_sync(vllm.put, 1, other, [0, 8])]
                hit = await client.lookup(other)
                loaded = await client.load("l", other, [[10, 11], [12], [0, 11]], hit)
    assert saved.stored == 4 and saved.failed == 0
    assert all(code > 0 for codes in got for code in codes)
    for j in range(3):
        assert all(same(received[f"attn.{i}"][4 + j], engine[f"attn.{i}"][1 + j])
                   for i in range(2))
    assert same(received["mamba.1"][13], engine["mamba.1"][3])
    assert not same(received["ring.0"][6], engine["ring.0"][3])
    assert put == [[0, 0], [0]]
    assert hit == 2 * BLOCK and loaded.loaded_tokens == hit and not loaded.invalid_block_ids
    assert same(engine["attn.1"][10], vllm.caches["attn.1"][7])
    assert same(engine["mamba.0"][11], vllm.caches["mamba.0"][8])
    assert not same(engine["ring.0"][12], vllm.caches["ring.0"][12])


@pytest.mark.asyncio(loop_scope="module")
async def test_a_vllm_value_of_another_geometry_is_never_a_hit(
    master: EmbeddedMaster, vllm_sides: Callable[..., VllmSide],
) -> None:
    """A mixed fleet whose values differ: keys vLLM wrote with another size are no hit,
    the save reports them skipped(foreign_value), and nothing is loaded from them."""
    layout = dense_layout(0, 1) | {"model": "tiny-mixed"}
    tokens = random_tokens(2 * BLOCK + 1, seed=9)
    other = {f"attn.{i}": private((NUM_BLOCKS, 1, BLOCK, HEAD_DIM)) for i in range(3)}
    fill(other, seed=30)
    writer = vllm_sides(layout, other)
    assert await anyio.to_thread.run_sync(writer.put, 0, tokens, [1, 2]) == [0, 0]
    engine = dense_caches(shared)
    with run_sidecar_process(sidecar_config(master, verify="if_present")) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await connect(sidecar.endpoint, layout, engine) as client:
                hit = await client.lookup(tokens)
                saved = await client.save("s", tokens, [[3, 4]])
    assert hit == 0
    assert {(b.status, b.reason) for b in saved.blocks} == {("skipped", "foreign_value")}


@pytest.mark.asyncio(loop_scope="module")
async def test_a_vllm_value_without_a_checksum_is_refused_when_required(
    master: EmbeddedMaster, vllm_sides: Callable[..., VllmSide],
) -> None:
    """store.verify: required: a value vLLM wrote (no checksum beside it) is no hit, and
    a load of it fails instead of copying unverified bytes."""
    layout = dense_layout(0, 1) | {"model": "tiny-verify"}
    tokens = random_tokens(2 * BLOCK + 1, seed=11)
    writer_caches = dense_caches(private)
    fill(writer_caches, seed=40)
    writer = vllm_sides(layout, writer_caches)
    assert await anyio.to_thread.run_sync(writer.put, 0, tokens, [1, 2]) == [0, 0]
    engine = dense_caches(shared)
    before = engine["attn.0"][5].clone()
    with run_sidecar_process(sidecar_config(master, verify="required")) as sidecar:
        with anyio.fail_after(TIMEOUT):
            async with await connect(sidecar.endpoint, layout, engine) as client:
                hit = await client.lookup(tokens)
                loaded = await client.load("l", tokens, [[5, 6]], 2 * BLOCK)
    assert hit == 0
    assert loaded.loaded_tokens == 0 and set(loaded.invalid_block_ids) == {5, 6}
    assert same(engine["attn.0"][5], before)
