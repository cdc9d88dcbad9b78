"""The embedded store: an LRU cache in one preallocated arena, copies in worker threads."""

from __future__ import annotations

import random
from collections.abc import Awaitable
from typing import Any

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.backends.stores.arena import ArenaAllocator
from pipeline.backends.stores.embedded import EmbeddedStore, index_budget, index_charge
from pipeline.core.config import EmbeddedStoreConfig
from pipeline.core.errors import StoreError
from pipeline.core.outcomes import LOADED, MISSING, PRESENT, STORE_FULL, STORED, BlockStatus, failed
from pipeline.core.runs import VALUE_ALIGN, value_span
from pipeline.core.store import KVStore, Presence
from tests.kit import views_at

WAIT_S = 10.0


def value(size: int, seed: int) -> torch.Tensor:
    """``size`` bytes whose content depends on ``seed``."""
    return (torch.arange(size, dtype=torch.int64) * 7 + seed).remainder(256).to(torch.uint8)


def make_store(capacity: int, limiter: anyio.CapacityLimiter | None = None) -> EmbeddedStore:
    """A store that packs values back to back, so these tests count bytes as they put them
    (the padding to cache lines has tests of its own)."""
    return EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=capacity), copy_limiter=limiter,
                         value_align=1)


async def read(store: EmbeddedStore, key: str, size: int) -> torch.Tensor | None:
    buffer = torch.zeros(size, dtype=torch.uint8)
    [outcome] = await store.get_into([key], [buffer])
    return buffer if outcome == LOADED else None


async def stored(store: EmbeddedStore, keys: list[str]) -> list[bool]:
    """Whether each key holds a readable value, of whatever size."""
    return [p is not Presence.ABSENT for p in await store.exists(keys, [1] * len(keys))]


async def wait_for_waiters(limiter: anyio.CapacityLimiter, count: int) -> None:
    """Let the started tasks run until they block, then check they wait for copy threads."""
    await wait_all_tasks_blocked()
    assert limiter.statistics().tasks_waiting == count


# -- allocator -------------------------------------------------------------------------


def test_allocator_best_fit_and_coalescing_restore_one_hole() -> None:
    """Freed extents merge with both neighbours until the whole arena is one hole again."""
    allocator = ArenaAllocator(100)
    a, b, c = (allocator.allocate(size) for size in (10, 20, 30))
    assert (a, b, c) == (0, 10, 30)
    allocator.free(0, 10)
    allocator.free(30, 30)
    assert allocator.allocate(25) == 30  # best fit: the 30-byte hole, not the 40-byte tail
    allocator.free(30, 25)
    allocator.free(10, 20)
    assert allocator.holes == 1
    assert allocator.free_bytes == 100
    assert allocator.allocate(100) == 0


def test_allocator_refuses_what_no_hole_fits() -> None:
    """A request larger than every hole gets None even when total free bytes suffice."""
    allocator = ArenaAllocator(30)
    for _ in range(3):
        allocator.allocate(10)
    allocator.free(0, 10)
    allocator.free(20, 10)
    assert allocator.free_bytes == 20
    assert allocator.allocate(20) is None


# -- KVStore behaviour -----------------------------------------------------------------


async def test_is_a_kvstore() -> None:
    """The embedded store satisfies the KVStore protocol."""
    async with make_store(64) as store:
        assert isinstance(store, KVStore)


async def test_put_then_get_round_trips_bytes() -> None:
    """A stored value is loaded byte for byte and reported as existing."""
    with anyio.fail_after(WAIT_S):
        async with make_store(1024) as store:
            assert await store.put(["a", "b"], [value(100, 1), value(50, 2)]) == [STORED] * 2
            assert await stored(store, ["a", "b", "c"]) == [True, True, False]
            loaded = await read(store, "a", 100)
            assert loaded is not None and torch.equal(loaded, value(100, 1))


async def test_put_of_present_key_does_not_overwrite() -> None:
    """Putting an existing key reports PRESENT and keeps the first value."""
    with anyio.fail_after(WAIT_S):
        async with make_store(1024) as store:
            await store.put(["a"], [value(16, 1)])
            assert await store.put(["a"], [value(16, 2)]) == [PRESENT]
            loaded = await read(store, "a", 16)
            assert loaded is not None and torch.equal(loaded, value(16, 1))


async def test_duplicate_key_in_one_batch_is_stored_once() -> None:
    """The second occurrence of a key within one put is PRESENT."""
    with anyio.fail_after(WAIT_S):
        async with make_store(1024) as store:
            outcomes = await store.put(["a", "a"], [value(16, 1), value(16, 2)])
            assert outcomes == [STORED, PRESENT]
            assert store.stats().used_bytes == 16


async def test_exists_tells_a_value_of_another_size_from_a_missing_one() -> None:
    """exists() is PRESENT only at the size asked for; another size is FOREIGN."""
    async with make_store(4096) as store:
        await store.put(["a"], [value(100, 1)])
        assert await store.exists(["a", "a", "b"], [100, 64, 100]) == [
            Presence.PRESENT, Presence.FOREIGN, Presence.ABSENT,
        ]


async def test_eviction_is_reported_with_the_evicted_keys() -> None:
    """on_evicted hears exactly the keys evicted to make room."""
    heard: list[str] = []
    async with EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=256),
                             on_evicted=heard.extend) as store:
        await store.put(["a", "b"], [value(128, 1), value(128, 2)])
        await store.put(["c"], [value(128, 3)])
        assert heard == ["a"]
        assert await stored(store, ["a", "b", "c"]) == [False, True, True]


async def test_get_of_absent_key_is_missing() -> None:
    """A key never stored is MISSING."""
    with anyio.fail_after(WAIT_S):
        async with make_store(64) as store:
            assert await store.get_into(["x"], [torch.zeros(4, dtype=torch.uint8)]) == [MISSING]


async def test_get_into_wrong_size_buffer_fails_with_sizes() -> None:
    """A buffer of another size fails the key with both sizes in the reason."""
    with anyio.fail_after(WAIT_S):
        async with make_store(64) as store:
            await store.put(["a"], [value(16, 1)])
            outcome = await store.get_into(["a"], [torch.zeros(8, dtype=torch.uint8)])
            assert outcome == [failed("size_mismatch: stored 16 bytes, buffer 8")]


async def test_value_larger_than_arena_is_store_full_without_evicting() -> None:
    """A value that could never fit is skipped as store_full and evicts nothing."""
    with anyio.fail_after(WAIT_S):
        async with make_store(64) as store:
            await store.put(["a"], [value(32, 1)])
            assert await store.put(["big"], [value(65, 2)]) == [STORE_FULL]
            assert await stored(store, ["a"]) == [True]
            assert store.stats().evictions == 0


async def test_bad_and_empty_values_fail_per_key() -> None:
    """A non-byte or empty value fails its own key; the rest of the batch is stored."""
    with anyio.fail_after(WAIT_S):
        async with make_store(64) as store:
            outcomes = await store.put(
                ["f", "e", "ok"],
                [torch.zeros(4, dtype=torch.float32), torch.zeros(0, dtype=torch.uint8),
                 value(4, 1)],
            )
            assert [o.status for o in outcomes] == [
                BlockStatus.FAILED, BlockStatus.FAILED, BlockStatus.STORED
            ]
            assert outcomes[0].reason.startswith("bad_value: expected a 1-D uint8 tensor")
            assert outcomes[1] == failed("bad_value: empty")
            assert store.stats().keys == 1


async def test_batch_larger_than_arena_does_not_evict_its_own_values() -> None:
    """Values of one put are pinned until copied, so the overflow of a batch is skipped."""
    with anyio.fail_after(WAIT_S):
        async with make_store(40) as store:
            outcomes = await store.put(["a", "b", "c"], [value(16, i) for i in range(3)])
            assert outcomes == [STORED, STORED, STORE_FULL]
            assert store.stats().evictions == 0


async def test_least_recently_used_is_evicted_first() -> None:
    """A get refreshes recency, so the untouched oldest key is the one evicted."""
    with anyio.fail_after(WAIT_S):
        async with make_store(48) as store:
            await store.put(["a", "b", "c"], [value(16, i) for i in range(3)])
            assert await read(store, "a", 16) is not None
            assert await store.put(["d"], [value(16, 3)]) == [STORED]
            assert await stored(store, ["a", "b", "c", "d"]) == [True, False, True, True]
            assert store.stats().evictions == 1


async def test_present_put_refreshes_recency() -> None:
    """Re-putting a key counts as a use, protecting it from the next eviction."""
    with anyio.fail_after(WAIT_S):
        async with make_store(48) as store:
            await store.put(["a", "b", "c"], [value(16, i) for i in range(3)])
            assert await store.put(["a"], [value(16, 9)]) == [PRESENT]
            await store.put(["d"], [value(16, 3)])
            assert await stored(store, ["a", "b"]) == [True, False]


async def test_eviction_of_small_neighbours_makes_room_for_a_large_value() -> None:
    """Holes left by evicted values of one size coalesce into room for a larger one."""
    with anyio.fail_after(WAIT_S):
        async with make_store(64) as store:
            await store.put([f"s{i}" for i in range(8)], [value(8, i) for i in range(8)])
            assert await store.put(["big"], [value(40, 9)]) == [STORED]
            assert await stored(store, [f"s{i}" for i in range(8)]) == [False] * 5 + [True] * 3
            loaded = await read(store, "big", 40)
            assert loaded is not None and torch.equal(loaded, value(40, 9))


async def test_remove_frees_bytes_and_counts_present_keys() -> None:
    """remove returns how many keys it found, and their bytes become free."""
    with anyio.fail_after(WAIT_S):
        async with make_store(64) as store:
            await store.put(["a", "b"], [value(16, 1), value(16, 2)])
            assert await store.remove(["a", "x", "a"]) == 1
            assert store.stats().used_bytes == 16
            assert await store.get_into(["a"], [torch.zeros(16, dtype=torch.uint8)]) == [MISSING]


async def test_stats_report_usage_keys_and_evictions() -> None:
    """stats counts used bytes, capacity, keys and evictions."""
    with anyio.fail_after(WAIT_S):
        async with make_store(40) as store:
            await store.put(["a", "b"], [value(16, 1), value(16, 2)])
            await store.put(["c"], [value(16, 3)])
            stats = store.stats()
            assert (stats.used_bytes, stats.capacity_bytes, stats.keys, stats.evictions) == (
                32, 40, 2, 1
            )


async def test_closed_store_refuses_calls_and_closes_once() -> None:
    """After aclose every call raises StoreError; aclose is idempotent."""
    store = make_store(64)
    await store.aclose()
    await store.aclose()
    with pytest.raises(StoreError, match="closed"):
        await stored(store, ["a"])


async def test_register_buffer_rejects_non_byte_tensors() -> None:
    """A staging buffer must be a contiguous 1-D uint8 tensor."""
    async with make_store(64) as store:
        await store.register_buffer(torch.zeros(128, dtype=torch.uint8))
        with pytest.raises(ValueError, match="1-D uint8"):
            await store.register_buffer(torch.zeros(4, 4, dtype=torch.uint8))


# -- copies off the event loop, pinning ------------------------------------------------


async def test_entry_being_read_is_not_evicted_or_overwritten() -> None:
    """While a get copies a value out, a put needing room evicts others, never it."""
    limiter = anyio.CapacityLimiter(1)
    with anyio.fail_after(WAIT_S):
        async with make_store(32, limiter) as store:
            await store.put(["a", "b"], [value(16, 1), value(16, 2)])
            buffer = torch.zeros(16, dtype=torch.uint8)
            results: dict[str, object] = {}

            async def run(name: str, call: Awaitable[object]) -> None:
                results[name] = await call

            await limiter.acquire()
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "get", store.get_into(["a"], [buffer]))
                await wait_for_waiters(limiter, 1)
                tg.start_soon(run, "put", store.put(["c"], [value(16, 3)]))
                await wait_for_waiters(limiter, 2)
                # a and c are pinned: nothing is left to evict for another value.
                assert await store.put(["d"], [value(16, 4)]) == [STORE_FULL]
                assert await stored(store, ["a", "b", "c"]) == [True, False, False]
                limiter.release()
            assert results == {"get": [LOADED], "put": [STORED]}
            assert torch.equal(buffer, value(16, 1))
            loaded = await read(store, "c", 16)
            assert loaded is not None and torch.equal(loaded, value(16, 3))


async def test_removed_while_pinned_keeps_bytes_until_copy_ends() -> None:
    """Removing a key being read frees its bytes only after the copy finishes."""
    limiter = anyio.CapacityLimiter(1)
    with anyio.fail_after(WAIT_S):
        async with make_store(32, limiter) as store:
            await store.put(["a"], [value(16, 1)])
            buffer = torch.zeros(16, dtype=torch.uint8)
            await limiter.acquire()
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.get_into, ["a"], [buffer])
                await wait_for_waiters(limiter, 1)
                assert await store.remove(["a"]) == 1
                assert store.stats().used_bytes == 16
                limiter.release()
            assert torch.equal(buffer, value(16, 1))
            assert store.stats().used_bytes == 0


async def test_cancelled_put_releases_its_reservation() -> None:
    """A put cancelled before its copy ran leaves no key and no used bytes behind."""
    limiter = anyio.CapacityLimiter(1)
    with anyio.fail_after(WAIT_S):
        async with make_store(32, limiter) as store:
            await limiter.acquire()
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.put, ["a"], [value(16, 1)])
                await wait_for_waiters(limiter, 1)
                assert await store.put(["a"], [value(16, 2)]) == [PRESENT]
                assert await stored(store, ["a"]) == [False]
                tg.cancel_scope.cancel()
            limiter.release()
            assert store.stats().used_bytes == 0
            assert await stored(store, ["a"]) == [False]


async def test_a_key_removed_while_its_value_is_copied_in_stays_absent() -> None:
    """A put whose key is removed before its copy lands leaves the key absent (and not
    loadable) once the copy is done; putting it again stores it anew. The same holds for
    a reservation removed before its commit."""
    limiter = anyio.CapacityLimiter(1)
    with anyio.fail_after(WAIT_S):
        async with make_store(64, limiter) as store:
            await limiter.acquire()
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.put, ["a"], [value(16, 1)])
                await wait_for_waiters(limiter, 1)
                assert await store.remove(["a"]) == 1
                limiter.release()
            assert await store.exists(["a"], [16]) == [Presence.ABSENT]
            assert await read(store, "a", 16) is None
            assert await store.put(["a"], [value(16, 2)]) == [STORED]
            assert await store.exists(["a"], [16]) == [Presence.PRESENT]

            extents = await store.reserve(["b"], 16)
            assert await store.remove(["b"]) == 1
            store.commit(extents, written=True)
            assert await store.exists(["a", "b"], [16, 16]) == [
                Presence.PRESENT, Presence.ABSENT]
            assert store.stats().used_bytes == 16


async def test_exists_checks_keys_against_sizes_one_for_one() -> None:
    """As many sizes as keys, or a ValueError naming both counts."""
    async with make_store(64) as store:
        with pytest.raises(ValueError, match="2 keys and 1 sizes"):
            await store.exists(["a", "b"], [16])


async def test_concurrent_puts_and_gets_load_only_exact_bytes() -> None:
    """Many tasks hammering a small arena never load a byte that was not put."""
    sizes = [8, 24, 40]

    def expected(key: int) -> torch.Tensor:
        return value(sizes[key % len(sizes)], key)

    async def worker(store: EmbeddedStore, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(60):
            keys = [rng.randrange(30) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.5:
                await store.put([str(k) for k in keys], [expected(k) for k in keys])
            elif rng.random() < 0.9:
                buffers = [torch.zeros_like(expected(k)) for k in keys]
                outcomes = await store.get_into([str(k) for k in keys], buffers)
                for k, buffer, outcome in zip(keys, buffers, outcomes, strict=True):
                    assert outcome in (LOADED, MISSING)
                    if outcome == LOADED:
                        assert torch.equal(buffer, expected(k))
            else:
                await store.remove([str(k) for k in keys])
            assert store.stats().used_bytes <= 200

    with anyio.fail_after(30):
        async with make_store(200) as store:
            async with anyio.create_task_group() as tg:
                for seed in range(8):
                    tg.start_soon(worker, store, seed)
            present = await stored(store, [str(k) for k in range(30)])
            assert store.stats().used_bytes == sum(
                expected(k).numel() for k in range(30) if present[k]
            )


# -- property ------------------------------------------------------------------------

CAPACITY = 96
keys_st = st.sampled_from("abcdefg")
sizes_st = st.sampled_from([8, 16, 24, 40, 97])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.tuples(keys_st, sizes_st, st.integers(0, 255)),
                                           min_size=1, max_size=3)),
        st.tuples(st.just("get"), st.lists(keys_st, min_size=1, max_size=3)),
        st.tuples(st.just("remove"), st.lists(keys_st, min_size=1, max_size=2)),
    ),
    max_size=40,
)


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(operations)
def test_any_sequence_stays_in_budget_and_loads_exact_bytes(
    ops: list[tuple[str, list[Any]]],
) -> None:
    """Any put/get/remove sequence keeps used <= capacity and loads only what was put."""

    async def scenario() -> None:
        # What may be in the store: key -> the bytes it was stored with.
        model: dict[str, torch.Tensor] = {}
        async with make_store(CAPACITY) as store:
            for op, args in ops:
                if op == "put":
                    keys = [k for k, _, _ in args]
                    values = [value(size, seed) for _, size, seed in args]
                    outcomes = await store.put(keys, values)
                    for key, data, outcome in zip(keys, values, outcomes, strict=True):
                        assert outcome in (STORED, PRESENT, STORE_FULL)
                        if outcome == STORED:
                            model[key] = data
                        if outcome == PRESENT:
                            assert key in model
                elif op == "get":
                    keys = [str(k) for k in args]
                    buffers = [
                        torch.zeros(model[k].numel() if k in model else 8, dtype=torch.uint8)
                        for k in keys
                    ]
                    outcomes = await store.get_into(keys, buffers)
                    for key, buffer, outcome in zip(keys, buffers, outcomes, strict=True):
                        if outcome == LOADED:
                            assert torch.equal(buffer, model[key])
                        else:
                            assert outcome == MISSING
                else:
                    keys = [str(k) for k in args]
                    await store.remove(keys)
                    for key in keys:
                        model.pop(key, None)
                stats = store.stats()
                assert stats.used_bytes <= stats.capacity_bytes
                present = await stored(store, list(model))
                assert stats.used_bytes == sum(
                    data.numel() for data, here in zip(model.values(), present, strict=True)
                    if here
                )
                assert stats.keys == sum(present)
                # At the size each was put with, every value readable is present.
                exact = await store.exists(list(model), [d.numel() for d in model.values()])
                assert exact == [Presence.PRESENT if here else Presence.ABSENT
                                 for here in present]

    async def main() -> None:
        with anyio.fail_after(WAIT_S):
            await scenario()

    anyio.run(main)


# -- lent memory (DirectKVStore) --------------------------------------------------------


async def test_reserved_extents_are_invisible_until_committed_and_then_loadable() -> None:
    """Values written into reserved extents become readable only on commit, byte-exact."""
    store = make_store(1 << 16)
    extents = await store.reserve(["a", "b"], 64)
    assert extents.outcomes == [STORED, STORED]
    for index, view in enumerate(views_at(extents.runs, 2)):
        assert view is not None
        view.copy_(value(64, index))
    assert await stored(store, ["a", "b"]) == [False, False]
    assert store.commit(extents, written=True) == [STORED, STORED]
    assert await stored(store, ["a", "b"]) == [True, True]
    assert torch.equal(await read(store, "b", 64), value(64, 1))  # type: ignore[arg-type]


async def test_a_batch_is_reserved_as_one_run_of_adjacent_extents() -> None:
    """Fresh keys of one batch sit back to back and are lent as one matrix."""
    store = make_store(1 << 16)
    extents = await store.reserve(["a", "b", "c"], 128)
    [run] = extents.runs
    rows = run.rows
    assert run.first == 0 and rows.shape == (3, 128) and rows.stride() == (128, 1)
    assert (run.address, run.stride) == (rows.data_ptr(), 128)
    pointers = [view.data_ptr() for view in views_at(extents.runs, 3) if view is not None]
    assert pointers == [pointers[0], pointers[0] + 128, pointers[0] + 256]


async def test_values_start_on_cache_lines_and_carry_no_padding_out() -> None:
    """By default every value is padded to VALUE_ALIGN: a batch's values sit one span
    apart, each on a cache line, the padding is counted as used, and values of sizes
    that are not multiples of it load back exactly, put one by one or reserved."""
    size = 1000  # a 992-byte payload and its 8-byte checksum, say
    span = value_span(size)
    assert span == 1024
    async with EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=4 * span)) as store:
        extents = await store.reserve(["a", "b", "c"], size)
        views = [view for view in views_at(extents.runs, 3) if view is not None]
        assert [view.data_ptr() % VALUE_ALIGN for view in views] == [0, 0, 0]
        assert [view.data_ptr() - views[0].data_ptr() for view in views] == [0, span, 2 * span]
        assert [view.numel() for view in views] == [size] * 3
        for index, view in enumerate(views):
            view.copy_(value(size, index))
        store.commit(extents, written=True)
        assert await store.put(["d"], [value(size, 3)]) == [STORED]
        assert store.stats().used_bytes == 4 * span
        for index, key in enumerate("abcd"):
            assert torch.equal(await read(store, key, size), value(size, index))  # type: ignore[arg-type]
        assert await store.put(["e"], [value(size, 4)]) == [STORED]  # evicts one whole span
        assert store.stats().used_bytes == 4 * span and store.stats().evictions == 1


async def test_reserve_reports_present_and_full_and_an_abandoned_reservation_frees() -> None:
    """Existing keys are PRESENT, no room is STORE_FULL; an unwritten commit gives the
    bytes back and the keys stay absent."""
    store = make_store(256)
    await store.put(["old"], [value(64, 0)])
    extents = await store.reserve(["old", "new", "huge"], 64)
    assert extents.outcomes[0] == PRESENT and views_at(extents.runs, 3)[0] is None
    assert extents.outcomes[1] == STORED
    outcomes = store.commit(extents, written=False)
    assert outcomes[1].status is BlockStatus.FAILED
    assert await stored(store, ["new"]) == [False]
    assert store.stats().used_bytes == 64
    too_big = await store.reserve(["x"], 1024)
    assert too_big.outcomes == [STORE_FULL]


async def test_leased_values_are_never_evicted_until_released() -> None:
    """A lease pins its values: a put that needs their room is refused, then succeeds
    once the lease is released."""
    store = make_store(128)
    await store.put(["a"], [value(128, 3)])
    lease = await store.lease(["a", "missing"], 128)
    assert lease.outcomes == [LOADED, MISSING]
    assert torch.equal(views_at(lease.runs, 2)[0], value(128, 3))  # type: ignore[arg-type]
    assert await store.put(["b"], [value(128, 4)]) == [STORE_FULL]
    store.release(lease)
    assert await store.put(["b"], [value(128, 4)]) == [STORED]
    assert await stored(store, ["a"]) == [False]


async def test_a_lease_lends_runs_and_lone_values_each_with_its_own_bytes() -> None:
    """Values reserved together lie back to back and are lent as one run; values put
    one by one, asked for out of order, are lent each alone: every row holds exactly
    its value."""
    size = 1000
    span = value_span(size)
    async with EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=8 * span)) as store:
        extents = await store.reserve(["a", "b", "c"], size)
        for index, view in enumerate(views_at(extents.runs, 3)):
            view.copy_(value(size, index))  # type: ignore[union-attr]
        store.commit(extents, written=True)
        for index, key in enumerate("de", start=3):
            assert await store.put([key], [value(size, index)]) == [STORED]
        lease = await store.lease(["e", "a", "b", "c", "missing", "d"], size)
        assert [(run.first, run.count) for run in lease.runs] == [(0, 1), (1, 3), (5, 1)]
        views = views_at(lease.runs, 6)
        assert lease.outcomes == [LOADED] * 4 + [MISSING, LOADED]
        assert [views[i].data_ptr() - views[1].data_ptr() for i in (1, 2, 3)] == [  # type: ignore[union-attr]
            0, span, 2 * span]
        for view, index in zip(views, [4, 0, 1, 2, None, 3], strict=True):
            if index is None:
                assert view is None
            else:
                assert view is not None and view.numel() == size
                assert torch.equal(view, value(size, index))
        store.release(lease)


async def test_a_lease_of_the_wrong_size_fails_naming_both_sizes() -> None:
    """A value of another size under the same key is never lent as if it fitted."""
    store = make_store(1024)
    await store.put(["a"], [value(100, 0)])
    [outcome] = (await store.lease(["a"], 64)).outcomes
    assert outcome.status is BlockStatus.FAILED and "100" in outcome.reason


# -- keys count -----------------------------------------------------------------------


async def test_long_keys_of_short_values_are_bounded_by_the_index_budget() -> None:
    """Keys are charged with the values they name: tiny values under long keys fill the
    index's budget, not memory, and the oldest are evicted to make room, as for values."""
    capacity = 1 << 28
    evicted: list[str] = []
    store = EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=capacity),
                          on_evicted=evicted.extend)
    keys = [f"{index:06d}" + "k" * 900 for index in range(20_000)]
    async with store:
        for batch in range(0, len(keys), 1000):
            outcomes = await store.put(keys[batch:batch + 1000],
                                       [value(8, i) for i in range(1000)])
            assert set(outcomes) == {STORED}
        most = index_budget(capacity) // index_charge(keys[0])
        assert 0 < store.stats().keys <= most < len(keys)
        assert evicted == keys[: len(keys) - store.stats().keys]
        assert await stored(store, keys[-1:]) == [True]
        assert await stored(store, keys[:1]) == [False]
