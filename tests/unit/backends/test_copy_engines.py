"""The copy engines the root composes: which thread copies a batch of which size."""

from __future__ import annotations

import random
import threading

import anyio
import msgspec
import torch

from pipeline.app.backends import open_backends
from pipeline.backends.cpu_copy import (
    INLINE_BYTES,
    LOAD_INLINE_BYTES,
    LOAD_STREAM_BYTES,
    SPLIT_BYTES,
)
from pipeline.backends.faults import Faults
from pipeline.core.config import Config, FaultsConfig
from pipeline.core.geometry import build_store_groups
from pipeline.core.integrity import verify_rows
from pipeline.core.layout import KVCacheLayout
from pipeline.core.runs import Run

TIMEOUT_S = 30.0
PAGE_BYTES = 256 << 10


def _copy_threads() -> set[str]:
    return {thread.name for thread in threading.enumerate()
            if thread.name.startswith(("kvsidecar-save", "kvsidecar-load"))}


def _one_layer(blocks: int) -> tuple[KVCacheLayout, torch.Tensor]:
    layout = KVCacheLayout.from_dict({"model": "m", "groups": [{
        "kind": "full_attention", "block_size": 16, "layers": ["a"], "dtype": "uint8",
        "page_bytes": PAGE_BYTES}]})
    return layout, torch.randint(0, 256, (blocks, PAGE_BYTES), dtype=torch.uint8)


def _small_store(capacity_bytes: int) -> Config:
    config = Config()
    return msgspec.structs.replace(config, store=msgspec.structs.replace(
        config.store, embedded=msgspec.structs.replace(
            config.store.embedded, capacity_bytes=capacity_bytes)))


async def test_a_load_of_up_to_4_mib_is_copied_on_the_event_loop_a_save_on_threads() -> None:
    """A batch of 8 blocks of 256 KiB (2 MiB): the load engine copies it on the event loop
    (an engine waits on a load, and a hand-off waits for a core twice), the save engine
    in its own threads (it is over 512 KiB). Both move every byte."""
    layout, kv = _one_layer(20)
    [geometry] = build_store_groups(layout, {"a": (kv, 0)})
    batch = 8
    assert INLINE_BYTES < batch * geometry.stored_bytes <= LOAD_INLINE_BYTES
    config = _small_store(1 << 20)
    values = torch.zeros(batch, geometry.stored_bytes, dtype=torch.uint8)
    runs = [Run(0, values)]
    with anyio.fail_after(TIMEOUT_S):
        async with open_backends(config, Faults(FaultsConfig()), on_evicted=print) as backends:
            before = _copy_threads()
            await backends.save_copy.gather(geometry, list(range(1, 1 + batch)), runs)
            saving = _copy_threads() - before
            intact = await backends.load_copy.scatter(
                geometry, list(range(11, 11 + batch)), runs)
            loading = _copy_threads() - before - saving
    assert intact == [True] * batch
    assert torch.equal(kv[11 : 11 + batch], kv[1 : 1 + batch])
    assert saving and all(name.startswith("kvsidecar-save") for name in saving)
    assert not loading


async def test_copies_written_around_the_caches_move_every_byte_and_no_corrupt_one() -> None:
    """Saves for the embedded store and loads from ``LOAD_STREAM_BYTES`` up are written
    with streaming stores: a batch of 20 blocks of 256 KiB (5 MiB) saved and loaded lands
    byte for byte, and a value with one flipped byte writes none of its block."""
    layout, kv = _one_layer(48)
    [geometry] = build_store_groups(layout, {"a": (kv, 0)})
    batch = 20
    assert batch * geometry.stored_bytes >= LOAD_STREAM_BYTES
    values = torch.zeros(batch, geometry.stored_bytes, dtype=torch.uint8)
    runs = [Run(0, values)]
    targets = list(range(25, 25 + batch))
    kv[targets] = 0
    with anyio.fail_after(TIMEOUT_S):
        async with open_backends(_small_store(1 << 20), Faults(FaultsConfig()),
                                 on_evicted=print) as backends:
            await backends.save_copy.gather(geometry, list(range(1, 1 + batch)), runs)
            values[7][PAGE_BYTES // 2] ^= 1
            intact = await backends.load_copy.scatter(geometry, targets, runs)
    assert intact == [index != 7 for index in range(batch)]
    kept = [index for index in range(batch) if index != 7]
    assert torch.equal(kv[[25 + index for index in kept]], kv[[1 + index for index in kept]])
    assert int(kv[25 + 7].count_nonzero()) == 0


async def test_a_save_split_over_the_copy_threads_seals_every_value_batch_after_batch() -> None:
    """Batch after batch of 18 MiB, each shared by the save threads (a value to
    whichever claims it first): every value holds its block's pages, sealed with
    xxh3's own checksum of its bytes. A checksum state on a copy thread's
    stack starts clean at every call: a seeded reset keeps the secret it finds when it
    finds the same seed, and the thread's stack still held its last call's state, the
    secret partly overwritten since, so that every checksum of a call came out wrong
    (in 22 to 28 batches of 30 here, before)."""
    page = 48 << 10
    layout = KVCacheLayout.from_dict({"model": "m", "groups": [{
        "kind": "full_attention", "block_size": 16, "layers": [f"l{i}" for i in range(24)],
        "dtype": "uint8", "page_bytes": page}]})
    generator = torch.Generator().manual_seed(7)
    kv = {layer: (torch.randint(0, 256, (64, page), dtype=torch.uint8, generator=generator), 0)
          for layer in layout.groups[0].layers}
    [geometry] = build_store_groups(layout, kv)
    assert geometry.checksum_seed is not None
    values = torch.zeros(16, geometry.stored_bytes, dtype=torch.uint8)
    assert values.numel() >= SPLIT_BYTES
    order = random.Random(5)
    with anyio.fail_after(TIMEOUT_S):
        async with open_backends(Config(), Faults(FaultsConfig()), on_evicted=print) as backends:
            for _ in range(30):
                block_ids = order.sample(range(64), len(values))
                await backends.save_copy.gather(geometry, block_ids, [Run(0, values)])
                assert verify_rows(values, geometry.value_bytes,
                                   geometry.checksum_seed) == [True] * len(values)
                pages = torch.stack([torch.stack([kv[layer][0][block] for layer in kv])
                                     for block in block_ids])
                assert torch.equal(values[:, :geometry.value_bytes].view_as(pages), pages)
