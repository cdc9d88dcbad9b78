"""Each stage driven directly: real sessions on small CPU tensors, an embedded store."""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import pytest
import torch
from anyio.abc import ObjectReceiveStream

from pipeline.backends.cpu_copy import (
    CopyThreads,
    CpuCopyEngine,
    gather_and_seal,
    page_addresses,
    verify_and_scatter,
)
from pipeline.backends.in_place_copy import (
    HelperThreads,
    InPlaceCopyEngine,
    read_in_place,
    seal_in_place,
)
from pipeline.backends.memory import LentMemory, StagingMemory
from pipeline.backends.staging import StagingPool
from pipeline.backends.stores.embedded import EmbeddedStore
from pipeline.backends.stores.wrapper import StoreWrapper
from pipeline.backends.threads import WorkerThreads
from pipeline.core.config import EmbeddedStoreConfig, EventsConfig
from pipeline.core.errors import StoreCallAbandoned, StoreError
from pipeline.core.geometry import build_store_groups
from pipeline.core.hashing import INLINE_TOKENS, block_hashes
from pipeline.core.integrity import CHECKSUM_BYTES
from pipeline.core.keys import keys_for, store_key
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import (
    BlockReport,
    Load,
    LoadDone,
    Lookup,
    LookupReply,
    RequestKeys,
    Save,
    SaveDone,
    pack_tokens,
)
from pipeline.core.outcomes import STORE_FULL, STORED, BlockStatus
from pipeline.core.runs import Run
from pipeline.core.seams import BatchMemory
from pipeline.core.store import KVStore, Presence
from pipeline.state.events import KVEventLog
from pipeline.state.history import BlockHistory, Verdict
from pipeline.state.jobs import (
    BlockTask,
    Job,
    JobTracker,
    LookupRequest,
    StagedBatch,
    StorePressure,
    TaskBatch,
)
from pipeline.state.sessions import EngineSession
from stages.commit import CommitStage
from stages.completion import CompletionStage, completion_message
from stages.dedup import DedupStage
from stages.fetch import FetchStage
from stages.group_filter import GroupFilterStage
from stages.hashing import HashingStage
from stages.lookup import FIRST_CHUNK_BLOCKS, PROBE_KNOWN_ABOVE, LookupStage
from stages.scatter import ScatterStage
from stages.transfer import TransferStage

NO_EVENTS = KVEventLog(EventsConfig())
TIMEOUT_S = 10
NUM_BLOCKS = 16

# -- layouts and sessions --------------------------------------------------------------------


def full(block_size: int, *layers: str) -> dict[str, Any]:
    return {"kind": "full_attention", "block_size": block_size, "layers": list(layers)}


def ring(capacity: int, *layers: str) -> dict[str, Any]:
    return {"kind": "circular_buffer", "block_size": capacity, "layers": list(layers)}


def mamba(block_size: int, *layers: str) -> dict[str, Any]:
    return {
        "kind": "mamba",
        "block_size": block_size,
        "mamba_cache_mode": "align",
        "layers": list(layers),
    }


def swa(block_size: int, window: int, *layers: str) -> dict[str, Any]:
    return {
        "kind": "sliding_window",
        "block_size": block_size,
        "sliding_window": window,
        "layers": list(layers),
    }


T = TypeVar("T")

HYBRID = [full(4, "attn.0", "attn.1"), ring(4, "ring.0"), mamba(4, "ssm.0")]
"""full + ring + mamba: store groups {0 -> 0, 2 -> 1}; the ring is never stored."""


def make_tensors(layout: KVCacheLayout, seed: int = 0) -> dict[str, tuple[torch.Tensor, int]]:
    """Attention layers K/V-first [2, N, block, 2]; others blocks-first [N, 3, 5]."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for group in layout.groups:
        for layer in group.layers:
            if group.kind == "mamba":
                tensors[layer] = (torch.randn(NUM_BLOCKS, 3, 5, generator=generator), 0)
            else:
                shape = (2, NUM_BLOCKS, group.block_size, 2)
                tensors[layer] = (torch.randn(*shape, generator=generator), 1)
    return tensors


@dataclasses.dataclass
class Harness:
    session: EngineSession
    tensors: dict[str, tuple[torch.Tensor, int]]
    tracker: JobTracker
    completions: ObjectReceiveStream[Job]
    store: EmbeddedStore
    pool: StagingPool
    limiter: anyio.CapacityLimiter
    memory: BatchMemory
    copy: CpuCopyEngine

    def job(self, message: Save | Load) -> Job:
        job = Job(self.session, message)
        self.tracker.accept(job)
        return job

    def finished(self) -> list[Job]:
        """Jobs the tracker has completed so far."""
        jobs = []
        while True:
            try:
                jobs.append(self.completions.receive_nowait())
            except anyio.WouldBlock:
                return jobs

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        tensor, block_dim = self.tensors[layer]
        return tensor[:, block_id] if block_dim else tensor[block_id]

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {layer: tensor.clone() for layer, (tensor, _) in self.tensors.items()}


def harness(
    groups: list[dict[str, Any]], *, seed: int = 0, lent: bool = False, **fields: Any
) -> Harness:
    """Stages over an embedded store, values in staging (or, ``lent``, in the store)."""
    layout = KVCacheLayout.from_dict({"groups": groups, "model": "m", **fields})
    layout.validate_for_store()
    tensors = make_tensors(layout, seed)
    session = EngineSession(
        "engine", b"id", layout, build_store_groups(layout, tensors), hash_seed=None
    )
    send, receive = anyio.create_memory_object_stream[Job](64)
    store = EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=1 << 20))
    pool = StagingPool(8 * 4096, 4096, load_slots=2)
    limiter = anyio.CapacityLimiter(2)
    memory: BatchMemory = (
        LentMemory(store) if lent else StagingMemory(pool, store, skip_when_full=False)
    )
    return Harness(
        session, tensors, JobTracker(send), receive, store, pool, limiter, memory,
        CpuCopyEngine(WorkerThreads(2, name="test-copy")),
    )


@pytest.fixture
def hybrid() -> Harness:
    return harness(HYBRID)


def tokens(count: int, start: int = 100) -> tuple[int, ...]:
    return tuple(range(start, start + count))


def save(token_ids: Sequence[int], *block_ids: Sequence[int], request_id: str = "r") -> Save:
    return Save(1, request_id, pack_tokens(token_ids), tuple(tuple(ids) for ids in block_ids))


def load(
    token_ids: Sequence[int], num_tokens: int, *block_ids: Sequence[int], request_id: str = "r"
) -> Load:
    return Load(
        2, request_id, pack_tokens(token_ids), tuple(tuple(ids) for ids in block_ids), num_tokens
    )


def planned(job: Job) -> list[tuple[int, int, int]]:
    return [(t.store_group, t.block_index, t.block_id) for t in job.planned]


def statuses(job: Job) -> dict[tuple[int, int], tuple[BlockStatus, str]]:
    """(kv-cache group id, block index) -> (status, reason) of every settled block."""
    return {(r.group_id, r.block_index): (r.status, r.reason) for r in job.reports}


def by_group(tasks: list[BlockTask]) -> list[list[BlockTask]]:
    groups: dict[int, list[BlockTask]] = {}
    for task in tasks:
        groups.setdefault(task.store_group, []).append(task)
    return list(groups.values())


async def run_save(h: Harness, message: Save) -> Job:
    """group_filter -> hashing -> dedup -> transfer -> commit, one batch per store group."""
    job = h.job(message)
    pressure = StorePressure()
    transfer = TransferStage(h.memory, h.copy, h.tracker, pressure)
    commit = CommitStage(h.memory, h.store, h.tracker, pressure, NO_EVENTS)
    if await GroupFilterStage(h.tracker).process(job) is None:
        return job
    named = await HashingStage(h.tracker, h.limiter).process(job)
    missing = await DedupStage(h.store, h.tracker).process(named) if named else None
    for batch in by_group(missing or []):
        staged = await transfer.process(batch)
        assert staged is not None
        await commit.process(staged)
    return job


async def run_load(h: Harness, message: Load) -> Job:
    """group_filter -> hashing -> fetch -> scatter, one batch per store group."""
    job = h.job(message)
    fetch = FetchStage(h.memory, h.tracker)
    scatter = ScatterStage(h.store, h.copy, h.tracker, NO_EVENTS)
    if await GroupFilterStage(h.tracker).process(job) is None:
        return job
    named = await HashingStage(h.tracker, h.limiter).process(job)
    for batch in by_group(named or []):
        staged = await fetch.process(batch)
        if staged is not None:
            await scatter.process(staged)
    return job


# -- group filter ----------------------------------------------------------------------------


async def test_group_filter_drops_the_ring_and_null_blocks_of_a_save(hybrid: Harness) -> None:
    """A save plans every non-null block of the stored groups, in store-group indices."""
    job = hybrid.job(save(tokens(12), [1, 2, 0], [9], [0, 0, 3]))
    with anyio.fail_after(TIMEOUT_S):
        assert await GroupFilterStage(hybrid.tracker).process(job) is job
    assert planned(job) == [(0, 0, 1), (0, 1, 2), (1, 2, 3)]
    assert job.pending == 3
    assert hybrid.finished() == []


async def test_group_filter_loads_only_what_the_hit_rule_needs(hybrid: Harness) -> None:
    """A load of 8 tokens takes full-attention blocks 0-1 and only mamba block 1."""
    job = hybrid.job(load(tokens(12), 8, [1, 2, 3], [9], [4, 5, 6]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(hybrid.tracker).process(job)
    assert planned(job) == [(0, 0, 1), (0, 1, 2), (1, 1, 5)]


async def test_group_filter_loads_only_the_window_of_a_sliding_window_group() -> None:
    """A window of 5 tokens before P = 16 needs only the sliding-window group's block 3."""
    h = harness([full(4, "attn.0"), swa(4, 5, "swa.0")])
    job = h.job(load(tokens(17), 16, [1, 2, 3, 4], [0, 0, 7, 8]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(h.tracker).process(job)
    assert planned(job) == [(0, 0, 1), (0, 1, 2), (0, 2, 3), (0, 3, 4), (1, 3, 8)]


async def test_a_job_with_nothing_to_move_completes_at_once(hybrid: Harness) -> None:
    """A save of only null blocks (and ring blocks) is completed by the filter itself."""
    job = hybrid.job(save(tokens(8), [0, 0], [5], [0, 0]))
    with anyio.fail_after(TIMEOUT_S):
        assert await GroupFilterStage(hybrid.tracker).process(job) is None
    assert hybrid.finished() == [job]
    assert job.reports == []


async def test_saves_yield_to_a_load_in_flight_until_it_finishes(hybrid: Harness) -> None:
    """A save waiting to copy goes on as soon as the loads in flight have finished."""
    load_job = hybrid.job(load(tokens(9), 8, [5, 6, 0], [9], [0, 7, 0]))
    went_on = anyio.Event()

    async def save_side() -> None:
        await hybrid.tracker.yield_to_loads(limit_s=60)
        went_on.set()

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(save_side)
            await anyio.wait_all_tasks_blocked()
            assert not went_on.is_set()
            await hybrid.tracker.settle(load_job, ())  # nothing pending: the load finishes
    assert went_on.is_set()


async def test_saves_yield_to_loads_for_at_most_the_limit(hybrid: Harness) -> None:
    """A load that never finishes holds saves back for the limit only; none, no wait."""
    with anyio.fail_after(TIMEOUT_S):
        await hybrid.tracker.yield_to_loads(limit_s=60)  # no load in flight
        hybrid.job(load(tokens(9), 8, [5, 6, 0], [9], [0, 7, 0]))
        started = anyio.current_time()
        await hybrid.tracker.yield_to_loads(limit_s=0.05)
        assert anyio.current_time() - started >= 0.05


# -- hashing ---------------------------------------------------------------------------------


async def test_hashing_names_blocks_with_their_store_keys() -> None:
    """Block j of a group k fine blocks wide is keyed by fine hash (j+1)*k - 1, per store group."""
    h = harness(
        [full(8, "attn.0"), ring(4, "ring.0"), mamba(4, "ssm.0")], cache_prefix="ns", tp_rank=1,
        tp_size=2,
    )
    token_ids = tokens(16)
    job = h.job(save(token_ids, [1, 2], [9], [0, 0, 0, 3]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(h.tracker).process(job)
        named = await HashingStage(h.tracker, h.limiter).process(job)
    fine = block_hashes(token_ids, 4)
    assert named is not None
    keys = {(t.store_group, t.block_index): t.key for t in named}
    namespace = f"@store_format:kvsidecar_native_{h.session.layout.geometry_fingerprint}"
    common = {"cache_prefix": "ns", "tp_rank": 1, "namespace": namespace}
    assert keys == {
        (0, 0): store_key("m", fine[1], store_group=0, **common),
        (0, 1): store_key("m", fine[3], store_group=0, **common),
        (1, 3): store_key("m", fine[3], store_group=1, **common),
    }
    assert keys[(1, 3)] == f"ns@m{namespace}@tp_rank:1@pcp0@dcp0@pp_rank:0@group:1@{fine[3].hex()}"


@pytest.mark.parametrize("count", [INLINE_TOKENS, INLINE_TOKENS + 16])
async def test_hashing_names_every_block_of_a_long_prompt_alike_inline_or_in_a_thread(
    count: int,
) -> None:
    """A prompt up to INLINE_TOKENS long is hashed on the event loop, a longer one in a
    worker thread: every block is named by the same chain of hashes either way."""
    h = harness([full(16, "attn.0")])
    token_ids = tokens(count)
    job = h.job(save(token_ids, list(range(1, count // 16 + 1))))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(h.tracker).process(job)
        named = await HashingStage(h.tracker, h.limiter).process(job)
    assert named is not None and len(named) == count // 16
    assert [t.block_hash for t in named] == block_hashes(token_ids, 16)


async def test_hashing_skips_the_incomplete_tail(hybrid: Harness) -> None:
    """Blocks past the last full hash block are settled skipped(incomplete_block)."""
    job = hybrid.job(save(tokens(10), [1, 2, 3], [9], [4, 5, 6]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(hybrid.tracker).process(job)
        named = await HashingStage(hybrid.tracker, hybrid.limiter).process(job)
    assert named is not None
    assert sorted((t.store_group, t.block_index) for t in named) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    skipped = (BlockStatus.SKIPPED, "incomplete_block")
    assert statuses(job) == {(0, 2): skipped, (2, 2): skipped}
    assert job.pending == 4 and hybrid.finished() == []


async def test_hashing_a_request_without_one_full_block_completes_it(hybrid: Harness) -> None:
    """With fewer tokens than one hash block nothing is named and the job completes."""
    job = hybrid.job(save(tokens(3), [1], [9], [2]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(hybrid.tracker).process(job)
        assert await HashingStage(hybrid.tracker, hybrid.limiter).process(job) is None
    assert hybrid.finished() == [job]
    assert {status for status, _ in statuses(job).values()} == {BlockStatus.SKIPPED}


# -- dedup -----------------------------------------------------------------------------------


async def dedup_with_first_block_stored(
    hybrid: Harness, size: int | None
) -> tuple[Job, BlockTask, TaskBatch | None]:
    """Dedup a 3-block save after storing ``size`` bytes (None: a value's own size)
    under its first block's key."""
    job = hybrid.job(save(tokens(8), [1, 2], [9], [0, 3]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(hybrid.tracker).process(job)
        named = await HashingStage(hybrid.tracker, hybrid.limiter).process(job)
        assert named is not None
        first = next(t for t in named if (t.store_group, t.block_index) == (0, 0))
        value = torch.ones(size or first.geometry.stored_bytes, dtype=torch.uint8)
        await hybrid.store.put([first.key], [value])
        return job, first, await DedupStage(hybrid.store, hybrid.tracker).process(named)


async def test_dedup_reports_present_blocks_and_passes_the_rest(hybrid: Harness) -> None:
    """Blocks already stored are settled present; only the missing ones go on."""
    job, first, missing = await dedup_with_first_block_stored(hybrid, None)
    assert missing is not None and first not in missing and len(missing) == 2
    assert statuses(job) == {(0, 0): (BlockStatus.PRESENT, "")}


async def test_dedup_skips_a_key_holding_a_value_of_another_size(hybrid: Harness) -> None:
    """A key whose value this engine cannot read is neither present nor written again:
    the block is skipped as foreign_value."""
    job, first, missing = await dedup_with_first_block_stored(hybrid, 8)
    assert missing is not None and first not in missing and len(missing) == 2
    assert statuses(job) == {(0, 0): (BlockStatus.SKIPPED, "foreign_value")}


async def test_dedup_of_an_all_present_job_completes_it(hybrid: Harness) -> None:
    """Saving the same blocks twice stores them once; the second save is all present."""
    with anyio.fail_after(TIMEOUT_S):
        await run_save(hybrid, save(tokens(8), [1, 2], [9], [0, 3]))
        again = await run_save(hybrid, save(tokens(8), [4, 5], [9], [0, 6], request_id="r2"))
    assert set(statuses(again).values()) == {(BlockStatus.PRESENT, "")}
    assert hybrid.finished()[-1] is again


async def test_dedup_settles_failed_when_the_store_is_down(hybrid: Harness) -> None:
    """A store that cannot answer fails every block of the job; none goes on."""
    job = hybrid.job(save(tokens(8), [1, 2], [9], [0, 3]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(hybrid.tracker).process(job)
        named = await HashingStage(hybrid.tracker, hybrid.limiter).process(job)
        await hybrid.store.aclose()
        assert await DedupStage(hybrid.store, hybrid.tracker).process(named or []) is None
    assert {s for s, _ in statuses(job).values()} == {BlockStatus.FAILED}
    assert all(reason.startswith("store:") for _, reason in statuses(job).values())
    assert hybrid.finished() == [job]


# -- transfer, commit, fetch, scatter --------------------------------------------------------


async def test_save_then_load_round_trips_bytes_into_other_blocks(hybrid: Harness) -> None:
    """Bytes saved from blocks (1, 2 | 3) land exactly in blocks (5, 6 | 7); nothing else moves."""
    token_ids = tokens(9)
    with anyio.fail_after(TIMEOUT_S):
        await hybrid.store.register_buffer(hybrid.pool.buffer)
        saved = await run_save(hybrid, save(token_ids, [1, 2, 0], [9], [0, 3, 0]))
        assert set(statuses(saved).values()) == {(BlockStatus.STORED, "")}
        assert len(saved.reports) == 3
        before = hybrid.snapshot()
        loaded = await run_load(hybrid, load(token_ids, 8, [5, 6, 0], [9], [0, 7, 0]))
    assert hybrid.finished() == [saved, loaded]
    assert set(statuses(loaded).values()) == {(BlockStatus.LOADED, "")}
    for layer in ("attn.0", "attn.1"):
        for src, dst in ((1, 5), (2, 6)):
            assert torch.equal(
                hybrid.block(layer, dst).view(torch.int32),
                hybrid.block(layer, src).view(torch.int32),
            )
    assert torch.equal(hybrid.block("ssm.0", 7), hybrid.block("ssm.0", 3))
    changed = {
        (layer, block)
        for layer, (tensor, block_dim) in hybrid.tensors.items()
        for block in range(NUM_BLOCKS)
        if not torch.equal(
            tensor[:, block] if block_dim else tensor[block],
            before[layer][:, block] if block_dim else before[layer][block],
        )
    }
    assert changed == {("attn.0", 5), ("attn.0", 6), ("attn.1", 5), ("attn.1", 6), ("ssm.0", 7)}
    assert hybrid.pool.free_slots("load") == 2 and hybrid.pool.free_slots("save") == 6
    message = completion_message(loaded)
    assert isinstance(message, LoadDone)
    assert (message.loaded_tokens, message.invalid_block_ids) == (8, ())


def test_shared_tensors_are_stored_once_per_value() -> None:
    """Two layers aliasing one tensor contribute its K and V segments once."""
    layout = KVCacheLayout.from_dict({"groups": [full(4, "a", "b")], "model": "m"})
    shared = torch.randn(2, NUM_BLOCKS, 4, 2)
    groups = build_store_groups(layout, {"a": (shared, 1), "b": (shared, 1)})
    assert len(groups[0].segments) == 2  # K and V of one tensor
    assert groups[0].value_bytes == 2 * 4 * 2 * 4


@pytest.mark.parametrize(("threads", "inline_bytes"), [(1, 0), (2, 0), (3, 0), (2, 1 << 20)])
async def test_split_copies_round_trip_and_verify_each_row(
    hybrid: Harness, threads: int, inline_bytes: int
) -> None:
    """A batch's copy, split across threads or done inline, moves every byte of values in
    two runs, and the checksums checked row by row fail exactly the corrupted value,
    which never reaches the engine."""
    geometry = hybrid.session.store_groups[0]  # two K/V-first layers: four segments
    copy = CopyThreads(WorkerThreads(threads, name="test"), split_bytes=0,
                       inline_bytes=inline_bytes)
    memory = torch.zeros(6, geometry.stored_bytes, dtype=torch.uint8)
    values = [memory[i] for i in (0, 1, 2, 4, 5)]
    runs = [Run(0, memory[0:3]), Run(3, memory[4:6])]  # a gap at 3: two runs
    before = hybrid.snapshot()
    with anyio.fail_after(TIMEOUT_S):
        await gather_and_seal(copy, geometry, [1, 2, 3, 4, 5], runs)
        values[3][0] ^= 0xFF
        intact = await verify_and_scatter(copy, geometry, [11, 12, 13, 14, 15], runs)
    assert intact == [True, True, True, False, True]
    for source, target in ((1, 11), (2, 12), (3, 13), (5, 15)):
        for layer in ("attn.0", "attn.1"):
            assert torch.equal(hybrid.block(layer, target), before[layer][:, source])
    for layer in ("attn.0", "attn.1"):
        assert torch.equal(hybrid.block(layer, 14), before[layer][:, 14])


async def test_block_ids_out_of_range_are_refused_before_any_copy(hybrid: Harness) -> None:
    """An id past the engine's blocks, or a negative one, raises IndexError and leaves
    the values and the engine's blocks as they were."""
    geometry = hybrid.session.store_groups[0]
    copy = CopyThreads(WorkerThreads(1, name="test"))
    values = torch.zeros(2, geometry.stored_bytes, dtype=torch.uint8)
    before = hybrid.snapshot()
    for ids in ([1, geometry.num_blocks], [-1, 2]):
        with pytest.raises(IndexError, match="out of range"):
            await gather_and_seal(copy, geometry, ids, [Run(0, values)])
        with pytest.raises(IndexError, match="out of range"):
            await verify_and_scatter(copy, geometry, ids, [Run(0, values)])
    assert int(values.count_nonzero()) == 0
    after = hybrid.snapshot()
    assert all(torch.equal(after[layer], before[layer]) for layer in before)


async def test_checksums_in_place_are_those_of_the_copied_values_and_fail_what_changed(
    hybrid: Harness,
) -> None:
    """Checksums sealed over blocks' pages where they lie in the engine, for the values
    asked for only, are exactly the trailers a copying engine seals after the same
    values; measured again where they landed, the check fails exactly the block whose
    pages changed and the one whose trailer did."""
    geometry = hybrid.session.store_groups[0]  # two K/V-first layers: four segments
    copied = torch.zeros(4, geometry.stored_bytes, dtype=torch.uint8)
    views = torch.zeros(4, 2 * CHECKSUM_BYTES, dtype=torch.uint8)  # [sealed | measured]
    sealed, measured = views[:, :CHECKSUM_BYTES], views[:, CHECKSUM_BYTES:]
    with anyio.fail_after(TIMEOUT_S):
        await gather_and_seal(CopyThreads(WorkerThreads(2, name="test")), geometry,
                              [1, 2, 3, 4], [Run(0, copied)])
    pages = page_addresses(geometry, [1, 2, 3, 4])
    seal_in_place(geometry, pages, sealed, [1, 3])
    assert not views[0].any() and not views[2].any()
    seal_in_place(geometry, pages, sealed, [0, 2])
    assert torch.equal(views[:, :CHECKSUM_BYTES], copied[:, geometry.value_bytes :])
    hybrid.block("attn.1", 2)[1, 0, 0] += 1.0  # V of the second layer, block 2
    views[3, 0] ^= 0xFF
    seal_in_place(geometry, pages, measured, [0, 1, 2, 3])
    with anyio.fail_after(TIMEOUT_S):
        intact = await InPlaceCopyEngine().scatter(geometry, [1, 2, 3, 4], [Run(0, views)])
    assert intact == [True, False, True, False]


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
async def test_values_read_where_a_store_holds_them_land_checked_in_one_pass(
    hybrid: Harness, shared: bool,
) -> None:
    """Values a store holds whole in this process's memory, apart from one another, are
    copied into their engine blocks as a copying engine would restore them; each row
    holds the value's checksum twice, but one whose bytes changed in the store is not
    copied at all and its halves differ, so the in-place check fails it. Alike when a
    helper thread shares the batch."""
    geometry = hybrid.session.store_groups[0]
    copy = CopyThreads(WorkerThreads(2, name="test"))

    async def values_of(block_ids: list[int]) -> torch.Tensor:
        values = torch.zeros(len(block_ids), geometry.stored_bytes, dtype=torch.uint8)
        with anyio.fail_after(TIMEOUT_S):
            await gather_and_seal(copy, geometry, block_ids, [Run(0, values)])
        return values

    span = geometry.stored_bytes + 4096  # values lie apart, as a store places them
    held = torch.zeros(4, span, dtype=torch.uint8)
    held[:, : geometry.stored_bytes] = await values_of([1, 2, 3, 4])
    held[2, 5] ^= 0xFF
    untouched = await values_of([7])
    rows = torch.full((5, 2 * CHECKSUM_BYTES), 7, dtype=torch.uint8)
    helpers = HelperThreads(1, share_bytes=0) if shared else None
    try:
        read_in_place(geometry, page_addresses(geometry, [0, 5, 6, 7, 8]), rows,
                      [1, 2, 3, 4], [row.data_ptr() for row in held], helpers=helpers)
    finally:
        if helpers is not None:
            helpers.close()
    assert torch.equal(rows[0], torch.full((2 * CHECKSUM_BYTES,), 7, dtype=torch.uint8))
    with anyio.fail_after(TIMEOUT_S):
        intact = await InPlaceCopyEngine().scatter(geometry, [0, 5, 6, 7, 8], [Run(0, rows)])
    assert intact == [True, True, True, False, True]
    landed = await values_of([5, 6, 7, 8])
    for k in (0, 1, 3):
        assert torch.equal(landed[k], held[k, : geometry.stored_bytes])
        assert torch.equal(rows[k + 1, :CHECKSUM_BYTES], landed[k, geometry.value_bytes :])
    assert torch.equal(landed[2], untouched[0])


@pytest.mark.parametrize(("split_bytes", "inline_bytes", "where"), [
    (0, 0, "shared"),      # split: every worker thread, one progress table between them
    (1 << 30, 0, "one"),   # below split_bytes: one worker thread, not shared
    (0, 1 << 30, "loop"),  # up to inline_bytes: on the event loop, not shared
])
async def test_a_copy_runs_on_the_loop_on_one_worker_thread_or_shared_by_them_all(
    split_bytes: int, inline_bytes: int, where: str
) -> None:
    """A small batch is copied on the event loop, a larger one by a worker thread, and
    one of ``split_bytes`` or more by every worker thread, which share its runs through
    one progress table (each value to whichever claims it first)."""
    threads = 3
    calls: list[tuple[int, object]] = []

    def copy(progress: object, limit: int) -> int:
        assert limit == 0
        calls.append((threading.get_ident(), progress))
        return 7 if progress is None else 0  # a shared call claims nothing here

    copy_threads = CopyThreads(WorkerThreads(threads, name="test"), split_bytes=split_bytes,
                               inline_bytes=inline_bytes)
    with anyio.fail_after(TIMEOUT_S):
        await copy_threads.run(copy, 2, 7, 16)
    assert len(calls) == (threads if where == "shared" else 1)
    assert all((ident == threading.get_ident()) == (where == "loop") for ident, _ in calls)
    if where == "shared":
        progress = calls[0][1]
        assert all(table is progress for _, table in calls)
        assert getattr(progress, "shape", None) == (2, 2)
    else:
        assert calls[0][1] is None


async def test_a_missing_key_fails_the_block_and_never_scatters(hybrid: Harness) -> None:
    """Loading blocks never saved settles them failed(missing) and writes no engine byte."""
    before = hybrid.snapshot()
    with anyio.fail_after(TIMEOUT_S):
        job = await run_load(hybrid, load(tokens(9), 8, [5, 6], [9], [0, 7]))
    assert hybrid.finished() == [job]
    assert set(statuses(job).values()) == {(BlockStatus.FAILED, "missing")}
    assert all(torch.equal(before[layer], tensor) for layer, (tensor, _) in hybrid.tensors.items())
    assert hybrid.pool.free_slots("load") == 2
    message = completion_message(job)
    assert isinstance(message, LoadDone)
    assert message.loaded_tokens == 0
    assert sorted(message.invalid_block_ids) == [5, 6, 7]


async def test_a_middle_block_missing_loads_the_others_into_the_right_blocks() -> None:
    """With block 1 of 3 missing, blocks 0 and 2 still land exactly; the hit stops at 4."""
    h = harness([full(4, "attn.0")])
    token_ids = tokens(13)
    with anyio.fail_after(TIMEOUT_S):
        await run_save(h, save(token_ids, [1, 0, 3]))
        fetch = FetchStage(h.memory, h.tracker)
        job = h.job(load(token_ids, 12, [5, 6, 7]))
        await GroupFilterStage(h.tracker).process(job)
        named = await HashingStage(h.tracker, h.limiter).process(job)
        staged = await fetch.process(named or [])
        assert isinstance(staged, StagedBatch)
        assert [t.block_id for t in staged.tasks] == [5, 7]
        await ScatterStage(h.store, h.copy, h.tracker, NO_EVENTS).process(staged)
    assert torch.equal(h.block("attn.0", 5), h.block("attn.0", 1))
    assert torch.equal(h.block("attn.0", 7), h.block("attn.0", 3))
    assert not torch.equal(h.block("attn.0", 6), h.block("attn.0", 2))
    message = completion_message(job)
    assert isinstance(message, LoadDone)
    assert message.loaded_tokens == 4
    assert message.invalid_block_ids == (6,)
    assert [r.status for r in message.blocks] == [
        BlockStatus.LOADED,
        BlockStatus.FAILED,
        BlockStatus.LOADED,
    ]


async def test_transfer_skips_and_reports_when_staging_is_full(hybrid: Harness) -> None:
    """Under overflow=skip a save finding no free slot is settled skipped(staging_full)."""
    job = hybrid.job(save(tokens(8), [1, 2], [9], [0, 3]))
    held = [hybrid.pool.try_take("save") for _ in range(hybrid.pool.free_slots("save"))]
    skipping = StagingMemory(hybrid.pool, hybrid.store, skip_when_full=True)
    transfer = TransferStage(skipping, hybrid.copy, hybrid.tracker, StorePressure())
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(hybrid.tracker).process(job)
        named = await HashingStage(hybrid.tracker, hybrid.limiter).process(job)
        assert await transfer.process(named or []) is None
    assert set(statuses(job).values()) == {(BlockStatus.SKIPPED, "staging_full")}
    assert hybrid.finished() == [job]
    assert all(slot is not None for slot in held)


async def staged_save(h: Harness) -> tuple[Job, StagedBatch]:
    """A save of two attention blocks through the transfer into a staging slot."""
    job = h.job(save(tokens(8), [1, 2], [9], [0, 0]))
    transfer = TransferStage(h.memory, h.copy, h.tracker, StorePressure())
    await GroupFilterStage(h.tracker).process(job)
    named = await HashingStage(h.tracker, h.limiter).process(job)
    staged = await transfer.process(named or [])
    assert staged is not None and h.pool.free_slots("save") == 5
    return job, staged


async def test_commit_fails_blocks_and_frees_the_slot_when_the_store_is_down(
    hybrid: Harness,
) -> None:
    """A put on a closed store fails the batch with a store reason and releases the slot."""
    with anyio.fail_after(TIMEOUT_S):
        job, staged = await staged_save(hybrid)
        await hybrid.store.aclose()
        await CommitStage(hybrid.memory, hybrid.store, hybrid.tracker, StorePressure(),
                          NO_EVENTS).process(staged)
    assert hybrid.pool.free_slots("save") == 6
    assert {s for s, _ in statuses(job).values()} == {BlockStatus.FAILED}
    assert hybrid.finished() == [job]


class AbandoningStore(StoreWrapper):
    """The harness's store, except that every put and get overruns and is abandoned
    until ``finish_calls``."""

    def __init__(self, inner: KVStore) -> None:
        super().__init__(inner)
        self._on_return: list[Callable[[], None]] = []

    async def _around(self, name: str, call: Callable[[], Awaitable[T]]) -> T:
        if name in ("put", "get"):
            raise StoreCallAbandoned(f"{name} did not return in time", self._on_return.append)
        return await call()

    def finish_calls(self) -> None:
        for callback in self._on_return:
            callback()


async def test_commit_withholds_the_slot_of_an_abandoned_put(hybrid: Harness) -> None:
    """A put that may still read its slot fails its blocks; the slot is out of use
    until the put returns."""
    store = AbandoningStore(hybrid.store)
    with anyio.fail_after(TIMEOUT_S):
        job, staged = await staged_save(hybrid)
        memory = StagingMemory(hybrid.pool, store, skip_when_full=False)
        await CommitStage(memory, store, hybrid.tracker, StorePressure(), NO_EVENTS).process(staged)
    assert hybrid.pool.free_slots("save") == 5
    assert hybrid.pool.withheld == 1
    assert {s for s, _ in statuses(job).values()} == {BlockStatus.FAILED}
    assert hybrid.finished() == [job]
    store.finish_calls()
    assert hybrid.pool.free_slots("save") == 6
    assert hybrid.pool.withheld == 0


async def test_fetch_withholds_the_slot_of_an_abandoned_get(hybrid: Harness) -> None:
    """A get that may still write its slot fails its blocks; the slot is out of use
    until the get returns."""
    token_ids = tokens(9)
    store = AbandoningStore(hybrid.store)
    with anyio.fail_after(TIMEOUT_S):
        await run_save(hybrid, save(token_ids, [1, 2, 0], [9], [0, 3, 0]))
        job = hybrid.job(load(token_ids, 8, [5, 6, 0], [9], [0, 7, 0]))
        await GroupFilterStage(hybrid.tracker).process(job)
        named = await HashingStage(hybrid.tracker, hybrid.limiter).process(job)
        fetch = FetchStage(StagingMemory(hybrid.pool, store, skip_when_full=False), hybrid.tracker)
        for batch in by_group(named or []):
            assert await fetch.process(batch) is None
    assert hybrid.pool.free_slots("load") == 0
    assert hybrid.pool.withheld == 2
    assert {s for s, _ in statuses(job).values()} == {BlockStatus.FAILED}
    store.finish_calls()
    assert hybrid.pool.free_slots("load") == 2
    assert hybrid.pool.withheld == 0


# -- completion ------------------------------------------------------------------------------


def finished_job(
    h: Harness, message: Save | Load, outcomes: dict[tuple[int, int, int], BlockStatus]
) -> Job:
    """A job whose (store group, index, block id) blocks were settled with ``outcomes``."""
    job = Job(h.session, message)
    for (store_group, index, block_id), status in outcomes.items():
        kv_group = h.session.store_groups[store_group].kv_group_id
        job.reports.append(BlockReport(kv_group, index, block_id, status))
    return job


def test_completion_of_a_load_stops_at_a_failed_middle_block() -> None:
    """Full attention with block 1 of 3 failed: 4 tokens loaded, the failed id invalid."""
    h = harness([full(4, "attn.0")])
    job = finished_job(
        h,
        load(tokens(13), 12, [5, 6, 7]),
        {
            (0, 0, 5): BlockStatus.LOADED,
            (0, 1, 6): BlockStatus.FAILED,
            (0, 2, 7): BlockStatus.LOADED,
        },
    )
    message = completion_message(job)
    assert isinstance(message, LoadDone)
    assert (message.loaded_tokens, message.invalid_block_ids) == (4, (6,))


def test_completion_of_a_hybrid_load_needs_mamba_state_at_the_resume_point(
    hybrid: Harness,
) -> None:
    """A failed middle attention block leaves no resume point: mamba has state only at 12."""
    job = finished_job(
        hybrid,
        load(tokens(13), 12, [5, 6, 7], [9], [0, 0, 8]),
        {
            (0, 0, 5): BlockStatus.LOADED,
            (0, 1, 6): BlockStatus.FAILED,
            (0, 2, 7): BlockStatus.LOADED,
            (1, 2, 8): BlockStatus.LOADED,
        },
    )
    message = completion_message(job)
    assert isinstance(message, LoadDone)
    assert (message.loaded_tokens, message.invalid_block_ids) == (0, (6,))
    assert {r.group_id for r in message.blocks} == {0, 2}  # kv-cache group ids, not store


def test_completion_of_a_hybrid_load_with_the_mamba_block_failed(hybrid: Harness) -> None:
    """All attention loaded but the mamba state failed: nothing is usable."""
    job = finished_job(
        hybrid,
        load(tokens(9), 8, [5, 6], [9], [0, 8]),
        {
            (0, 0, 5): BlockStatus.LOADED,
            (0, 1, 6): BlockStatus.LOADED,
            (1, 1, 8): BlockStatus.FAILED,
        },
    )
    message = completion_message(job)
    assert isinstance(message, LoadDone)
    assert (message.loaded_tokens, message.invalid_block_ids) == (0, (8,))


def test_completion_of_a_save_lists_blocks_in_group_order(hybrid: Harness) -> None:
    """A save completion lists every block report sorted by kv-cache group and index."""
    job = finished_job(
        hybrid,
        save(tokens(8), [1, 2], [9], [0, 3]),
        {
            (1, 1, 3): BlockStatus.STORED,
            (0, 1, 2): BlockStatus.PRESENT,
            (0, 0, 1): BlockStatus.STORED,
        },
    )
    message = completion_message(job)
    assert isinstance(message, SaveDone)
    assert [(r.group_id, r.block_index, r.block_id, r.status) for r in message.blocks] == [
        (0, 0, 1, BlockStatus.STORED),
        (0, 1, 2, BlockStatus.PRESENT),
        (2, 1, 3, BlockStatus.STORED),
    ]


async def test_completion_stage_replies_and_forgets_the_job(hybrid: Harness) -> None:
    """The completion stage sends the reply to the job's session and closes the job."""
    job = hybrid.job(save(tokens(8), [0, 0], [9], [0, 0]))
    assert (hybrid.tracker.open_jobs, hybrid.session.jobs_in_flight) == (1, 1)
    with anyio.fail_after(TIMEOUT_S):
        reply = await CompletionStage(hybrid.tracker).process(job)
    assert (reply.session, reply.message) == (hybrid.session, SaveDone(1, "r", ()))
    assert (hybrid.tracker.open_jobs, hybrid.session.jobs_in_flight) == (0, 0)


async def test_an_answered_job_is_freed_without_the_cycle_collector(hybrid: Harness) -> None:
    """Once answered, a save's and a load's job and block tasks hold no reference cycle:
    they go when their last reference does, never left for a collector's pause."""
    token_ids = tokens(8)
    with anyio.fail_after(TIMEOUT_S):
        jobs = [await run_save(hybrid, save(token_ids, [1, 2], [9], [0, 3])),
                await run_load(hybrid, load(token_ids, 8, [4, 5], [9], [0, 6]))]
        assert hybrid.finished() == jobs and all(job.planned for job in jobs)
        for job in jobs:
            await CompletionStage(hybrid.tracker).process(job)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector frees is kept in gc.garbage
    try:
        del job, jobs
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, Job | BlockTask)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == []


async def test_a_batch_of_several_jobs_settles_each_once_its_last_block_is_in() -> None:
    """Blocks of two jobs, interleaved in one batch, each with its own outcome: each job
    completes once all its blocks are settled, with exactly its own outcomes, and the
    history hears what came of every block."""
    h = harness([full(4, "a")])
    history = BlockHistory(64)
    send, completions = anyio.create_memory_object_stream[Job](8)
    tracker = JobTracker(send, history=history)
    jobs = []
    for request, first in (("x", 100), ("y", 200)):
        job = Job(h.session, save(tokens(12, start=first), [1, 2, 3], request_id=request))
        tracker.accept(job)
        await GroupFilterStage(tracker).process(job)
        await HashingStage(tracker, h.limiter).process(job)
        jobs.append(job)
    x, y = (job.planned for job in jobs)
    await tracker.settle_each([x[0], y[0], x[1], y[1]],
                              [STORED, STORE_FULL, STORE_FULL, STORED])
    assert completions.statistics().current_buffer_used == 0  # a block of each is pending
    await tracker.settle_all([y[2], x[2]], STORED)
    # In the order the batch names them.
    assert [completions.receive_nowait(), completions.receive_nowait()] == jobs[::-1]
    assert [statuses(job) for job in jobs] == [
        {(0, 0): (BlockStatus.STORED, ""), (0, 1): (BlockStatus.SKIPPED, "store_full"),
         (0, 2): (BlockStatus.STORED, "")},
        {(0, 0): (BlockStatus.SKIPPED, "store_full"), (0, 1): (BlockStatus.STORED, ""),
         (0, 2): (BlockStatus.STORED, "")},
    ]
    prefix = h.session.store_groups[0].keys.own
    verdicts = [history.why(task.key, prefix, (0, task.block_hash), Presence.ABSENT,
                            RequestKeys())[:2] for task in (*x, *y)]
    assert verdicts == [
        (Verdict.EVICTED, "stored, since gone from the store"),
        (Verdict.SKIPPED, "store_full"),
        (Verdict.EVICTED, "stored, since gone from the store"),
        (Verdict.SKIPPED, "store_full"),
        (Verdict.EVICTED, "stored, since gone from the store"),
        (Verdict.EVICTED, "stored, since gone from the store"),
    ]



async def test_a_job_of_a_closed_session_released_by_its_answer_is_still_recorded() -> None:
    """The engine is gone (its session closed) when its last save is answered: answering
    it releases the session's groups, and the history still hears what came of each
    block, from the groups as they were."""
    h = harness([full(4, "a")])
    history = BlockHistory(64)

    class AnsweringLane:
        async def send(self, job: Job) -> None:
            await CompletionStage(tracker).process(job)
            assert h.session.store_groups == ()  # released with the answer

    tracker = JobTracker(AnsweringLane(), history=history)
    prefix = h.session.store_groups[0].keys.own
    job = Job(h.session, save(tokens(8), [1, 2]))
    tracker.accept(job)
    await GroupFilterStage(tracker).process(job)
    await HashingStage(tracker, h.limiter).process(job)
    planned = list(job.planned)
    h.session.close()
    await tracker.settle_each(planned, [STORED, STORE_FULL])
    assert [history.why(task.key, prefix, (0, task.block_hash), Presence.ABSENT,
                        RequestKeys())[:2] for task in planned] == [
        (Verdict.EVICTED, "stored, since gone from the store"),
        (Verdict.SKIPPED, "store_full"),
    ]


async def test_a_job_answered_at_once_is_recorded_in_the_history_after_its_reply() -> None:
    """A lane that answers a finished save at once (as ``AnswerWhereFinished`` does) forgets
    the job's blocks while answering it; the history hears what came of each block all
    the same, once the reply is out."""
    h = harness([full(4, "a")])
    history = BlockHistory(64)
    replies: list[SaveDone | LoadDone] = []

    class AnsweringLane:
        async def send(self, job: Job) -> None:
            reply = await CompletionStage(tracker).process(job)
            replies.append(reply.message)
            # Not yet in the history: the engine was not kept waiting for it.
            heard.extend(history.why(task.key, prefix, (0, task.block_hash),
                                     Presence.ABSENT, RequestKeys())[0] for task in planned)

    tracker = JobTracker(AnsweringLane(), history=history)
    prefix = h.session.store_groups[0].keys.own
    heard: list[Verdict] = []
    job = Job(h.session, save(tokens(8), [1, 2]))
    tracker.accept(job)
    await GroupFilterStage(tracker).process(job)
    await HashingStage(tracker, h.limiter).process(job)
    planned = list(job.planned)
    await tracker.settle_each(planned, [STORED, STORE_FULL])
    assert [r.status for r in replies[0].blocks] == [BlockStatus.STORED, BlockStatus.SKIPPED]
    assert job.planned == [] and tracker.open_jobs == 0
    assert heard == [Verdict.NEVER_STORED, Verdict.NEVER_STORED]
    assert [history.why(task.key, prefix, (0, task.block_hash), Presence.ABSENT,
                        RequestKeys())[:2] for task in planned] == [
        (Verdict.EVICTED, "stored, since gone from the store"),
        (Verdict.SKIPPED, "store_full"),
    ]

async def test_an_abandoned_job_fails_only_its_unsettled_blocks(hybrid: Harness) -> None:
    """On abort, an open job keeps the outcomes already settled; the rest fail."""
    job = hybrid.job(save(tokens(8), [1, 2], [9], [0, 3]))
    await GroupFilterStage(hybrid.tracker).process(job)
    await HashingStage(hybrid.tracker, hybrid.limiter).process(job)
    first, *others = job.planned
    await hybrid.tracker.settle_each([first], [STORED])
    assert hybrid.tracker.abandon_open("shutdown") == [job]
    assert statuses(job) == {
        (first.geometry.kv_group_id, first.block_index): (BlockStatus.STORED, ""),
        **{(task.geometry.kv_group_id, task.block_index): (BlockStatus.FAILED, "shutdown")
           for task in others},
    }


# -- lookup ----------------------------------------------------------------------------------


async def test_lookup_reports_the_hybrid_hit_and_keeps_the_last_token(hybrid: Harness) -> None:
    """After saving attention 0-2 and mamba state 2, only a hit at 12 is possible."""
    lookup = LookupStage(
        hybrid.store, {"default": {g.key_prefix: g.stored_bytes
                                   for g in hybrid.session.store_groups}}
    )
    token_ids = tokens(16)
    with anyio.fail_after(TIMEOUT_S):
        await run_save(hybrid, save(token_ids, [1, 2, 3, 0], [9], [0, 0, 4, 0]))
        hits = {
            count: await lookup.hit_tokens(
                hybrid.session, Lookup(0, pack_tokens(token_ids[:count]))
            )
            for count in (4, 12, 13, 16)
        }
        reply = await lookup.process(
            LookupRequest(hybrid.session, Lookup(5, pack_tokens(token_ids)))
        )
    # 12 tokens: the last one is recomputed, so the hit would be 8 and mamba has no state there.
    assert hits == {4: 0, 12: 0, 13: 12, 16: 12}
    assert reply.session is hybrid.session
    assert reply.message == LookupReply(5, 12)


class CountingStore(StoreWrapper):
    """The real store, counting the keys of each ``exists`` query."""

    def __init__(self, inner: KVStore) -> None:
        super().__init__(inner)
        self.queries: list[int] = []

    async def exists(self, keys: Sequence[str], sizes: Sequence[int]) -> list[Presence]:
        self.queries.append(len(keys))
        return await super().exists(keys, sizes)


@pytest.mark.parametrize("stored_blocks", [0, 5, 100, PROBE_KNOWN_ABOVE + 40])
async def test_known_hashes_of_a_long_prompt_are_probed_first_in_process(
    stored_blocks: int,
) -> None:
    """With the engine's hashes of a prompt longer than PROBE_KNOWN_ABOVE blocks, a store
    answering in-process is asked about a first chunk, then about the rest in one query;
    a miss in the first chunk ends the lookup there. A remote store is asked once. Both
    find the same hit."""
    dense = harness([full(4, "a")])
    [geometry] = dense.session.store_groups
    blocks = PROBE_KNOWN_ABOVE + 40
    prompt = tokens(blocks * 4 + 1)
    hashes = block_hashes(prompt, 4)
    [prefix] = geometry.keys.lookup
    sizes = {"default": {prefix: 8}}
    with anyio.fail_after(TIMEOUT_S):
        stored_keys = keys_for(prefix, hashes[:stored_blocks])
        await dense.store.put(stored_keys, [torch.zeros(8, dtype=torch.uint8)] * stored_blocks)
        hits = []
        for probe_first in (True, False):
            store = CountingStore(dense.store)
            lookup = LookupStage(store, sizes, probe_first=probe_first)
            hits.append(await lookup.hit_tokens(
                dense.session, Lookup(0, pack_tokens(prompt), block_hashes=tuple(hashes))))
            first_miss_in_probe = stored_blocks < FIRST_CHUNK_BLOCKS
            assert store.queries == (
                [blocks] if not probe_first
                else [FIRST_CHUNK_BLOCKS] if first_miss_in_probe
                else [FIRST_CHUNK_BLOCKS, blocks - FIRST_CHUNK_BLOCKS])
    assert hits == [stored_blocks * 4] * 2


async def test_a_lookup_yields_to_the_loop_only_while_it_hashes_much() -> None:
    """From its tokens, a prompt longer than INLINE_TOKENS lets other tasks run between
    its hashing chunks; a prompt of INLINE_TOKENS, or a long one whose hashes the
    session kept (looked up again under its request id), is answered without a yield.
    Every one finds its whole stored prefix."""
    dense = harness([full(4, "a")])
    [geometry] = dense.session.store_groups
    [prefix] = geometry.keys.lookup
    prompt = tokens(3 * INLINE_TOKENS + 1)
    hashes = block_hashes(prompt, 4)
    lookup = LookupStage(dense.store, {"default": {prefix: 8}}, probe_first=True)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.lowlevel.checkpoint()
            ticks += 1

    async def yields(message: Lookup, hit: int) -> int:
        before = ticks
        assert await lookup.hit_tokens(dense.session, message) == hit
        return ticks - before

    with anyio.fail_after(TIMEOUT_S):
        await dense.store.put(keys_for(prefix, hashes),
                              [torch.zeros(8, dtype=torch.uint8)] * len(hashes))
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            short = prompt[:INLINE_TOKENS]
            assert await yields(Lookup(0, pack_tokens(short)), INLINE_TOKENS - 4) == 0
            long = Lookup(0, pack_tokens(prompt), request_id="r")
            assert await yields(long, 3 * INLINE_TOKENS) >= 1
            assert await yields(long, 3 * INLINE_TOKENS) == 0  # hashes kept
            tg.cancel_scope.cancel()


async def test_a_full_store_puts_the_request_under_pressure_until_a_batch_is_stored(
    hybrid: Harness,
) -> None:
    """After store_full, later batches of that request are skipped without copying;
    a stored batch of any request lifts the pressure."""
    pressure = StorePressure()
    job = hybrid.job(save(tokens(8), [1, 2], [9], [0, 3]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(hybrid.tracker).process(job)
        named = await HashingStage(hybrid.tracker, hybrid.limiter).process(job)
    assert named
    first, rest = named[:1], named[1:]
    pressure.record(first, [STORE_FULL])
    skipped, kept = pressure.split(rest)
    assert skipped == rest and kept == []
    pressure.record(first, [STORED])
    assert pressure.split(rest) == ([], rest)


def test_a_run_of_values_one_padded_span_apart_moves_their_bytes_never_the_padding() -> None:
    """A direct store's values sit value_span(size) apart, one strided matrix: its span
    is one contiguous block, and the copies through it move the values' bytes, never
    the padding."""
    from pipeline.backends.cuda_copy import gather_blocks, scatter_blocks, span_of
    from pipeline.core.geometry import Segment
    from pipeline.core.runs import value_span

    size = 72  # two 32-byte pages and a checksum
    span = value_span(size)
    memory = torch.zeros(6 * span, dtype=torch.uint8)
    rows = memory.view(6, span)[:3, :size]
    assert span_of(rows).shape == (3, span) and span_of(rows).is_contiguous()

    pages = [torch.arange(i * 40, i * 40 + 4 * 32, dtype=torch.uint8).view(4, 32)
             for i in range(2)]
    segments = [Segment(page, i * 32) for i, page in enumerate(pages)]
    gather_blocks(segments, torch.tensor([3, 1, 2]), rows)
    assert torch.equal(rows[:, :32], pages[0][[3, 1, 2]])
    assert torch.equal(rows[:, 32:64], pages[1][[3, 1, 2]])
    assert int(memory.view(6, span)[:3, size:].count_nonzero()) == 0  # padding untouched
    targets = [torch.zeros_like(page) for page in pages]
    scatter_blocks([Segment(t, i * 32) for i, t in enumerate(targets)], torch.tensor([0, 1, 2]),
                   rows)
    assert torch.equal(targets[1][:3], pages[1][[3, 1, 2]])


async def test_values_lent_by_the_store_round_trip_exactly_and_hold_nothing_after() -> None:
    """With values copied straight into and out of store memory, a save then a load
    lands the same bytes in the new blocks, and a second save finds them present."""
    h = harness(HYBRID, lent=True)
    token_ids = tokens(9)
    with anyio.fail_after(TIMEOUT_S):
        saved = await run_save(h, save(token_ids, [1, 2, 0], [9], [0, 3, 0]))
        loaded = await run_load(h, load(token_ids, 8, [5, 6, 0], [9], [0, 7, 0]))
        again = await run_save(h, save(token_ids, [1, 2, 0], [9], [0, 3, 0]))
    assert set(statuses(saved).values()) == {(BlockStatus.STORED, "")}
    assert set(statuses(loaded).values()) == {(BlockStatus.LOADED, "")}
    assert set(statuses(again).values()) == {(BlockStatus.PRESENT, "")}
    for layer, src, dst in (("attn.0", 1, 5), ("attn.1", 2, 6), ("ssm.0", 3, 7)):
        assert torch.equal(h.block(layer, dst), h.block(layer, src))
    assert h.store.stats().keys == 3
    assert h.pool.free_slots("save") == 6 and h.pool.free_slots("load") == 2


async def test_a_failed_batch_gives_its_lent_reservation_back() -> None:
    """A staged batch failing as a whole (a fault after the copy) gives its memory back
    and settles each block with the store error."""
    h = harness(HYBRID, lent=True)
    job = h.job(save(tokens(8), [1, 2], [9], [0, 0]))
    with anyio.fail_after(TIMEOUT_S):
        await GroupFilterStage(h.tracker).process(job)
        named = await HashingStage(h.tracker, h.limiter).process(job)
        staged = await TransferStage(h.memory, h.copy, h.tracker, StorePressure()).process(
            named or []
        )
        assert staged is not None
        await staged.fail(StoreError("injected"), h.tracker)
    assert {reason for _, reason in statuses(job).values()} == {"store: injected"}
    assert h.finished() == [job]
    assert h.store.stats().keys == 0  # the reservation was given back, not stored
