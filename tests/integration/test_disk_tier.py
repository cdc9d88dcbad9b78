"""The disk tier on a real file system: values written behind memory come back whole
after a restart, damage is caught and dropped, a full or failing disk turns the tier off
while memory goes on serving, and the directory is the sidecar's alone."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy
import pytest
import torch

from pipeline.backends.stores.disk import DiskTier, open_disk_tier
from pipeline.backends.stores.disk.records import BLOCK, encode
from pipeline.backends.stores.embedded import EmbeddedStore
from pipeline.core.config import DiskStoreConfig, EmbeddedStoreConfig
from pipeline.core.errors import StoreError
from pipeline.core.outcomes import LOADED, MISSING, BlockStatus
from pipeline.core.runs import value_views
from pipeline.core.store import Presence, ValueScope

MiB = 1 << 20
SIZE = 60_000
SCOPE = ValueScope("tenant-a", "f00d")
WAIT_S = 20


def value(seed: int, size: int = SIZE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


def disk_config(path: Path, **overrides: object) -> DiskStoreConfig:
    settings: dict[str, object] = {"path": str(path), "bytes": 64 * MiB,
                                   "segment_bytes": 8 * MiB, "max_queued_bytes": 8 * MiB}
    settings.update(overrides)
    return DiskStoreConfig(**settings)  # type: ignore[arg-type]


def unpinned(store: EmbeddedStore) -> bool:
    """Whether no entry of the memory tier is pinned (no copy, lease or write holds one)."""
    index = store._index
    return index.pinned_bytes == 0 and all(e.pins == 0 for e in index.entries.values())


@contextlib.asynccontextmanager
async def opened(config: DiskStoreConfig, capacity: int = 4 * MiB, *, promote: bool = True,
                 fault: object = None) -> AsyncIterator[tuple[EmbeddedStore, DiskTier]]:
    """A memory tier of ``capacity`` over the disk tier of ``config``; once the disk is
    quiet at the end, nothing may be left pinned."""
    async with open_disk_tier(config, fault=fault) as tier:  # type: ignore[arg-type]
        store = EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=capacity), disk=tier,
                              on_evicted=lambda keys: None, promote=promote)
        try:
            yield store, tier
            await tier.flush(WAIT_S)
            assert unpinned(store)
        finally:
            await store.aclose()


async def save(store: EmbeddedStore, key: str, data: torch.Tensor,
               scope: ValueScope = SCOPE) -> None:
    extents = await store.reserve([key], data.numel(), scope=scope)
    views = value_views(extents.runs)
    if views:
        views[0].copy_(data)
    store.commit(extents, written=True)


async def load(store: EmbeddedStore, key: str, size: int = SIZE,
               scope: ValueScope | None = SCOPE) -> torch.Tensor | BlockStatus | str:
    extents = await store.lease([key], size, scope=scope)
    try:
        outcome = extents.outcomes[0]
        if outcome != LOADED:
            return outcome.reason or outcome.status
        return value_views(extents.runs)[0].clone()
    finally:
        store.release(extents)


async def settle(tier: DiskTier) -> None:
    assert await tier.flush(WAIT_S)


async def fill(store: EmbeddedStore, tier: DiskTier, count: int) -> None:
    """Save ``key-0`` .. ``key-{count - 1}``, each durable before the next is saved."""
    for i in range(count):
        await save(store, f"key-{i}", value(i))
        await settle(tier)


@contextlib.asynccontextmanager
async def writers_held(tier: DiskTier) -> AsyncIterator[None]:
    """Every writer thread's slot taken: nothing is written until the block ends."""
    limiter = tier._write_limiter
    borrowers = [object() for _ in range(int(limiter.total_tokens))]
    for borrower in borrowers:
        await limiter.acquire_on_behalf_of(borrower)
    try:
        yield
    finally:
        for borrower in borrowers:
            limiter.release_on_behalf_of(borrower)


async def test_values_written_behind_memory_come_back_after_a_restart(tmp_path: Path) -> None:
    """Save more than memory holds; every value is on disk, and after the tier is closed
    and opened again (a restart), each loads byte for byte from disk."""
    config = disk_config(tmp_path / "tier", max_queued_bytes=MiB // 2)
    truth = {f"key-{i}": value(i) for i in range(150)}  # 9 MB through a 4 MiB memory tier
    async with opened(config) as (store, tier):
        for i, (key, data) in enumerate(truth.items()):
            await save(store, key, data)
            if i % 8 == 7:
                await settle(tier)
        await settle(tier)
        assert len(tier.records) == len(truth) and tier.counters.skipped == 0
    async with opened(config) as (store, tier):
        assert len(tier.records) == len(truth)
        assert await store.exists(list(truth), [SIZE] * len(truth)) == [
            Presence.PRESENT] * len(truth)
        for key, data in truth.items():
            loaded = await load(store, key)
            assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, data), key
        assert tier.counters.reads >= len(truth) - 4 * MiB // SIZE


async def test_a_graceful_stop_writes_what_was_only_in_memory(tmp_path: Path) -> None:
    """Values still waiting for the disk when the store closes (the writers were held)
    are written then, within the flush deadline: the restart finds every one."""
    config = disk_config(tmp_path / "tier", max_queued_bytes=BLOCK * 16)  # one value queued
    truth = {f"key-{i}": value(i) for i in range(20)}
    async with opened(config, capacity=8 * MiB) as (store, tier):
        async with writers_held(tier):
            for key, data in truth.items():
                await save(store, key, data)
            assert len(tier.records) == 0
    async with opened(config) as (store, tier):
        assert set(tier.records) == set(truth)
        for key, data in truth.items():
            loaded = await load(store, key)
            assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, data)


async def test_a_disk_that_falls_behind_never_holds_up_saves(tmp_path: Path) -> None:
    """With every writer held, saves go on at memory speed: offers past the queue's bound
    wait, unpinned, and are written once the disk catches up; those evicted from memory
    before that are counted as skipped, never written, never waited for."""
    config = disk_config(tmp_path / "tier", max_queued_bytes=4 * 16 * BLOCK)
    async with opened(config, capacity=8 * MiB) as (store, tier):
        async with writers_held(tier):
            with anyio.fail_after(5):
                for i in range(20):
                    await save(store, f"key-{i}", value(i))
            assert len(tier.records) == 0 and tier.queued_bytes <= config.max_queued_bytes
            loaded = await load(store, "key-19")
            assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(19))
        await settle(tier)
        with anyio.fail_after(WAIT_S):
            while len(tier.records) < 20:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert tier.counters.skipped == 0
    config = disk_config(tmp_path / "small", max_queued_bytes=4 * 16 * BLOCK)
    async with opened(config, capacity=6 * SIZE) as (store, tier):
        async with writers_held(tier):
            with anyio.fail_after(5):
                for i in range(20):
                    await save(store, f"key-{i}", value(i))
            assert tier.counters.skipped > 0
        with anyio.fail_after(WAIT_S):
            while tier.counters.skipped + len(tier.records) < 20:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert tier.counters.skipped + len(tier.records) == 20


async def test_loads_from_disk_do_not_wait_behind_writes(tmp_path: Path) -> None:
    """With every writer thread held, a value on disk still loads: reads have threads of
    their own."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 3) as (store, tier):
        await fill(store, tier, 10)
        async with writers_held(tier):
            await save(store, "queued", value(99))  # its write waits for a writer
            with anyio.fail_after(5):
                loaded = await load(store, "key-0")
            assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(0))


async def test_the_budget_holds_and_the_oldest_segments_go(tmp_path: Path) -> None:
    """Past its budget the tier drops its oldest segment whole; it never holds more."""
    config = disk_config(tmp_path / "tier", bytes=64 * MiB, segment_bytes=8 * MiB)
    removed: list[str] = []

    def moved(keys: Sequence[str], medium: str, present: bool) -> None:
        if medium == "disk" and not present:
            removed.extend(keys)

    async with open_disk_tier(config) as tier:
        store = EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=2 * MiB), disk=tier,
                              on_moved=moved)
        for i in range(1400):  # ~90 MB of records
            await save(store, f"key-{i}", value(i))
            if i % 16 == 15:  # a disk that keeps up: nothing is skipped
                await settle(tier)
            assert tier.used_bytes <= config.bytes
        await settle(tier)
        await store.aclose()
        files = sum(f.stat().st_size for f in (tmp_path / "tier").glob("segment-*"))
        assert files == tier.used_bytes <= config.bytes
        assert tier.counters.skipped == 0
        assert tier.counters.evicted > 0 and "key-0" in removed
        assert "key-1399" in tier.records and "key-0" not in tier.records


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


async def test_flipped_bytes_on_disk_are_caught_dropped_and_recomputed(tmp_path: Path) -> None:
    """A flipped value byte fails the read (the block is missing, to be recomputed) and
    its record leaves the index; a flipped header byte drops the record at the next
    start, and the records after it are still found."""
    config = disk_config(tmp_path / "tier")
    truth = {f"key-{i}": value(i) for i in range(6)}
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        for key, data in truth.items():
            await save(store, key, data)
            await settle(tier)
        where = {key: tier.records[key].offset for key in truth}
    segment = next((tmp_path / "tier").glob("segment-*"))
    flip(segment, where["key-1"] + BLOCK + 10)  # in the value
    flip(segment, where["key-3"] + 70)  # in the key, under the header checksum
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        assert "key-3" not in tier.records and tier.counters.dropped == {"checksum": 1}
        assert await load(store, "key-1") == MISSING.reason
        assert "key-1" not in tier.records
        assert tier.counters.dropped == {"checksum": 2}
        for key in ("key-0", "key-2", "key-4", "key-5"):
            loaded = await load(store, key)
            assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, truth[key])
    async with opened(config, capacity=SIZE * 2) as (store, tier):  # a tombstone holds
        assert "key-1" not in tier.records and tier.counters.dropped == {"checksum": 1}


async def test_a_record_of_an_unknown_version_is_dropped(tmp_path: Path) -> None:
    """A record written by another format version is never loaded; the rest are."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        await fill(store, tier, 3)
        at = tier.records["key-1"].offset
    segment = next((tmp_path / "tier").glob("segment-*"))
    with segment.open("r+b") as file:
        file.seek(at + 4)
        file.write((2).to_bytes(2, "little"))
    async with opened(config) as (store, tier):
        assert set(tier.records) == {"key-0", "key-2"}
        assert tier.counters.dropped == {"version": 1}


async def test_a_write_cut_off_is_never_loaded(tmp_path: Path) -> None:
    """A record whose value was not all written (the tail of its blocks never reached
    the disk) fails its checksum: missing, never wrong."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        await fill(store, tier, 3)
        record = tier.records["key-2"]
    segment = next((tmp_path / "tier").glob("segment-*"))
    with segment.open("r+b") as file:
        file.seek(record.offset + record.span - 2 * BLOCK)
        file.write(bytes(2 * BLOCK))
    async with opened(config) as (store, tier):
        assert await load(store, "key-2") == MISSING.reason
        loaded = await load(store, "key-0")
        assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(0))


async def test_values_are_lent_only_to_their_scope(tmp_path: Path) -> None:
    """A value on disk is a miss for another tenant and foreign for another layout."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        await save(store, "key", value(1))
        await settle(tier)
    async with opened(config) as (store, tier):
        assert await load(store, "key", scope=ValueScope("tenant-b", SCOPE.fingerprint)) \
            == MISSING.reason
        reason = await load(store, "key", scope=ValueScope(SCOPE.tenant, "beef"))
        assert isinstance(reason, str) and reason.startswith("foreign_value")
        loaded = await load(store, "key")
        assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(1))
        assert tier.index.tenant_bytes == {SCOPE.tenant: tier.records["key"].span}


@pytest.mark.parametrize("promote", [True, False])
async def test_promotion_is_a_policy(tmp_path: Path, promote: bool) -> None:
    """on_hit: a value loaded from disk is in memory afterwards; never: it is not."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 4) as (store, tier):
        await save(store, "key", value(1))
        await settle(tier)
    async with opened(config, capacity=SIZE * 4, promote=promote) as (store, tier):
        loaded = await load(store, "key")
        assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(1))
        assert (store.stats().keys == 1) is promote
        await load(store, "key")
        assert tier.counters.reads == (1 if promote else 2)


async def test_an_io_error_turns_the_tier_off_and_memory_serves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """EIO on a write (a fault point): the tier is off, says so once, and saves and
    loads of values in memory go on."""
    config = disk_config(tmp_path / "tier")
    failing = {"disk.write": False}
    async with opened(config, capacity=SIZE * 8,
                      fault=lambda name: failing.get(name, False)) as (store, tier):
        await save(store, "before", value(1))
        await settle(tier)
        failing["disk.write"] = True
        await save(store, "during", value(2))
        with anyio.fail_after(WAIT_S):
            while tier.enabled:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert tier.counters.errors == 1 and not tier.records
        await save(store, "after", value(3))
        for key, seed in (("during", 2), ("after", 3)):
            loaded = await load(store, key)
            assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(seed))
    assert capsys.readouterr().out.count("store.disk.disabled") == 1


async def test_an_io_error_on_a_read_is_a_miss_and_turns_the_tier_off(tmp_path: Path) -> None:
    """EIO on a read: the block is missing (recomputed), the tier is off."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        await save(store, "key", value(1))
        await settle(tier)
    async with opened(config, fault=lambda name: name == "disk.read") as (store, tier):
        assert await load(store, "key") == MISSING.reason
        assert not tier.enabled
        assert await store.exists(["key"], [SIZE]) == [Presence.ABSENT]


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(mount)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_a_full_disk_turns_the_tier_off_and_memory_serves(tmp_path: Path) -> None:
    """On a 20 MiB tmpfs under a 64 MiB budget, the third segment cannot be allocated
    (ENOSPC): the tier turns off with its reason, and memory keeps every value since."""
    with small_tmpfs(tmp_path, "20m") as mount:
        config = disk_config(mount / "tier", max_queued_bytes=MiB)  # memory / 8
        async with opened(config, capacity=8 * MiB) as (store, tier):
            with anyio.fail_after(WAIT_S * 2):
                i = 0
                while tier.enabled:
                    await save(store, f"key-{i}", value(i))
                    await anyio.lowlevel.checkpoint()
                    i += 1
            assert tier.counters.errors == 1
            for j in range(i - 5, i):
                loaded = await load(store, f"key-{j}")
                assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(j))


async def test_the_directory_is_private_and_locked(tmp_path: Path) -> None:
    """Created 0700 with 0600 files; a second opener is refused while the first holds it;
    a directory open to others, or a symlink for one, is refused."""
    path = tmp_path / "a" / "tier"
    config = disk_config(path)
    async with opened(config) as (store, tier):
        await save(store, "key", value(1))
        await settle(tier)
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert {stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()} == {0o600}
        with pytest.raises(StoreError, match=f"pid {os.getpid()}"):
            async with open_disk_tier(config):
                pass
    path.chmod(0o755)
    with pytest.raises(StoreError, match="make it 0700"):
        async with open_disk_tier(config):
            pass
    link = tmp_path / "link"
    link.symlink_to(path, target_is_directory=True)
    path.chmod(0o700)
    with pytest.raises(StoreError, match="symlink"):
        async with open_disk_tier(disk_config(link)):
            pass


async def test_a_symlink_planted_as_a_segment_is_not_followed(tmp_path: Path) -> None:
    """A segment name that is a symlink (to a file the sidecar could read) is left
    alone: the tier opens without it, and the target is neither read nor written."""
    path = tmp_path / "tier"
    config = disk_config(path)
    async with opened(config) as (store, tier):
        await save(store, "key", value(1))
        await settle(tier)
    secret = tmp_path / "secret"
    secret.write_bytes(b"KVSD" + bytes(BLOCK * 4))
    (path / "segment-0000000009.kv").symlink_to(secret)
    async with opened(config) as (store, tier):
        assert set(tier.records) == {"key"}
        await save(store, "new", value(2))
        await settle(tier)
        assert all(record.segment.number > 9 for key, record in tier.records.items()
                   if key == "new")
    assert secret.read_bytes() == b"KVSD" + bytes(BLOCK * 4)
    assert (path / "segment-0000000009.kv").is_symlink()


async def test_a_removal_holds_against_a_write_in_flight_and_a_restart(tmp_path: Path) -> None:
    """A value removed while its write is queued is not indexed when the write lands,
    and a tombstone keeps a removed value from coming back at the next start; a value
    saved again after its removal stands (the later record wins)."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 8) as (store, tier):
        await save(store, "written", value(1))
        await settle(tier)
        async with writers_held(tier):
            await save(store, "queued", value(2))
            assert tier.writing("queued")
            assert await store.remove(["written", "queued"]) == 2
        await settle(tier)
        assert not tier.has("written") and not tier.has("queued")
        await save(store, "again", value(3))
        await settle(tier)
        assert await store.remove(["again"]) == 1
        await save(store, "again", value(4))
        await settle(tier)
    async with opened(config) as (store, tier):
        assert set(tier.records) == {"again"}
        loaded = await load(store, "again")
        assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(4))
        assert await store.exists(["written", "queued"], [SIZE, SIZE]) == [Presence.ABSENT] * 2


async def test_a_queue_smaller_than_one_record_still_writes(tmp_path: Path) -> None:
    """An empty queue takes any value that fits a batch, however small its bound."""
    config = disk_config(tmp_path / "tier", max_queued_bytes=BLOCK)
    async with opened(config, capacity=SIZE * 8) as (store, tier):
        for i in range(5):
            await save(store, f"key-{i}", value(i))
        with anyio.fail_after(WAIT_S):
            while len(tier.records) < 5:  # noqa: ASYNC110
                await anyio.sleep(0.01)


async def test_a_load_cancelled_during_a_disk_read_leaves_nothing_pinned(
        tmp_path: Path) -> None:
    """A lease whose caller is cancelled while its disk reads run waits for them (they
    write into its extents) and answers whole; once released, nothing stays pinned, and
    the value promoted from disk is readable."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 4) as (store, tier):
        await fill(store, tier, 4)
    async with opened(config, capacity=SIZE * 4) as (store, tier):
        await save(store, "in-memory", value(9))
        extents = None
        with anyio.move_on_after(0):  # cancelled at its first wait: the reads
            extents = await store.lease(["in-memory", "key-0", "key-1"], SIZE, scope=SCOPE)
        assert extents is not None and list(extents.outcomes) == [LOADED] * 3
        assert [torch.equal(view, value(seed)) for view, seed in
                zip(value_views(extents.runs), (9, 0, 1), strict=True)] == [True] * 3
        store.release(extents)
        await settle(tier)  # "in-memory" is pinned until its own write lands
        assert unpinned(store)
        assert store.where("key-0") == "in memory and on disk"


async def test_get_into_reads_values_from_disk(tmp_path: Path) -> None:
    """The copying interface loads values found only on disk too, checked."""
    config = disk_config(tmp_path / "tier")
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        await fill(store, tier, 3)
    async with opened(config, capacity=SIZE * 2) as (store, tier):
        buffers = [torch.empty(SIZE, dtype=torch.uint8) for _ in range(3)]
        outcomes = await store.get_into([f"key-{i}" for i in range(3)], buffers)
        assert outcomes == [LOADED] * 3
        assert all(torch.equal(buffer, value(i)) for i, buffer in enumerate(buffers))


async def test_a_lower_budget_at_start_drops_the_oldest_segments(tmp_path: Path) -> None:
    """A tier that holds more than its (lowered) budget opens, dropping its oldest
    segments until the budget holds."""
    config = disk_config(tmp_path / "tier", bytes=64 * MiB, segment_bytes=8 * MiB)
    async with opened(config, capacity=2 * MiB) as (store, tier):
        for i in range(600):  # ~37 MB: five segments
            await save(store, f"key-{i}", value(i))
            if i % 16 == 15:
                await settle(tier)
        await settle(tier)
        assert len(tier.space.segments) >= 5
    lowered = disk_config(tmp_path / "tier", bytes=24 * MiB, segment_bytes=8 * MiB)
    async with opened(lowered, capacity=2 * MiB) as (store, tier):
        assert tier.used_bytes <= lowered.bytes and tier.counters.evicted > 0
        assert "key-599" in tier.records and "key-0" not in tier.records
        loaded = await load(store, "key-599")
        assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(599))


async def test_a_record_forged_inside_a_value_is_never_taken_for_one(tmp_path: Path) -> None:
    """An engine stores a value holding a well-formed record for another key, placed on
    a block boundary of the file (made without the tier's secret), and the real record's
    header is lost: the scan, looking for the next record inside that value, refuses the
    forgery."""
    config = disk_config(tmp_path / "tier")
    forged = numpy.zeros(3 * BLOCK, dtype=numpy.uint8)
    encode(forged, "victim", "tenant-b", "beef", numpy.full(100, 7, dtype=numpy.uint8), 2**40,
           bytes(32))
    value_offset = 64 + len("carrier") + len(SCOPE.tenant) + len(SCOPE.fingerprint)
    carrier = torch.from_numpy(numpy.concatenate(
        [numpy.zeros(BLOCK - value_offset, dtype=numpy.uint8), forged]))
    async with opened(config, capacity=MiB) as (store, tier):
        await save(store, "carrier", carrier)
        await settle(tier)
        at = tier.records["carrier"].offset
    segment = next((tmp_path / "tier").glob("segment-*"))
    with segment.open("r+b") as file:
        file.seek(at + BLOCK)
        assert file.read(4) == b"KVSD"  # the forgery lies where a scan looks
        file.seek(at)
        file.write(bytes(64))  # the carrier's own header, gone
    async with opened(config) as (store, tier):
        assert "victim" not in tier.records and "carrier" not in tier.records
        assert tier.counters.dropped == {"checksum": 1}


async def test_a_hot_value_whose_segment_goes_is_kept_by_the_stop(tmp_path: Path) -> None:
    """A value still in memory when the budget evicts its record's segment is no longer
    on disk, and is not written again at once (that would evict more, in circles); the
    graceful stop writes it, so it survives the restart."""
    config = disk_config(tmp_path / "tier", bytes=32 * MiB, segment_bytes=8 * MiB)
    async with opened(config, capacity=2 * MiB) as (store, tier):
        await save(store, "hot", value(0))
        await settle(tier)
        for i in range(1, 700):
            await save(store, f"key-{i}", value(i))
            loaded = await load(store, "hot")  # keeps it in memory
            assert isinstance(loaded, torch.Tensor)
            if i % 16 == 0:
                await settle(tier)
        await settle(tier)
        assert tier.counters.evicted > 0 and store.where("hot") == "in memory"
    async with opened(config) as (store, tier):
        loaded = await load(store, "hot")
        assert isinstance(loaded, torch.Tensor) and torch.equal(loaded, value(0))
