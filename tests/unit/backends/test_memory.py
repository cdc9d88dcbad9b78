"""The batch memories against one contract: staging (values through the store's batch
calls) and lent store memory (values in the store itself), over a real embedded store."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import torch

from pipeline.backends.memory import STAGING_FULL, LentMemory, StagingMemory
from pipeline.backends.staging import StagingPool
from pipeline.backends.stores.embedded import EmbeddedStore
from pipeline.core.config import EmbeddedStoreConfig
from pipeline.core.geometry import StoreGroupGeometry, build_lookup_groups
from pipeline.core.layout import KVCacheLayout
from pipeline.core.outcomes import LOADED, MISSING, PRESENT, STORED, BlockStatus
from pipeline.core.seams import BatchMemory, Values
from tests.kit import views_at

TIMEOUT_S = 5
SIZE = 256
GEOMETRY = dataclasses.replace(
    build_lookup_groups(KVCacheLayout.from_dict(
        {"model": "m", "groups": [{"kind": "full_attention", "block_size": 4}]}))[0],
    value_bytes=SIZE,
)
"""A store group whose values are ``SIZE`` bytes (no engine memory: these memories
copy, and never read the blocks themselves)."""


def blocks(keys: list[str]) -> tuple[StoreGroupGeometry, list[int], list[str]]:
    """What a stage passes a memory for ``keys``: the group, engine blocks 1.., the keys."""
    return GEOMETRY, list(range(1, len(keys) + 1)), keys


@dataclasses.dataclass
class Setup:
    memory: BatchMemory
    store: EmbeddedStore
    pool: StagingPool


@pytest.fixture(params=["staging", "lent"])
def setup(request: pytest.FixtureRequest) -> Setup:
    store = EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=1 << 16))
    pool = StagingPool(4 * 4096, 4096, load_slots=1)
    memory: BatchMemory = (
        StagingMemory(pool, store, skip_when_full=False) if request.param == "staging"
        else LentMemory(store)
    )
    return Setup(memory, store, pool)


def fill(values: Values, seed: int) -> list[torch.Tensor]:
    """Random bytes into every view; copies of what was written."""
    generator = torch.Generator().manual_seed(seed)
    written = []
    for view in views_at(values.runs, len(values.keys)):
        assert view is not None
        view.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=generator))
        written.append(view.clone())
    return written


async def test_stored_values_are_fetched_byte_for_byte(setup: Setup) -> None:
    """Values written into reserved memory and stored come back exactly, in key order."""
    keys = ["a", "b", "c"]
    with anyio.fail_after(TIMEOUT_S):
        reserved = await setup.memory.reserve(*blocks(keys))
        written = fill(reserved, seed=1)
        assert await setup.memory.store(reserved) == [STORED] * 3
        fetched = await setup.memory.fetch(*blocks(["c", "a", "b"]))
    assert fetched.outcomes == [LOADED] * 3
    assert [view is not None and torch.equal(view, written[i])
            for view, i in zip(views_at(fetched.runs, 3), (2, 0, 1), strict=True)] == [True] * 3
    fetched.release()
    assert setup.pool.free_slots("save") == 3 and setup.pool.free_slots("load") == 1


async def test_released_values_are_not_stored_and_their_memory_comes_back(setup: Setup) -> None:
    """A reservation given back unstored leaves nothing readable and frees its memory,
    however often it is released."""
    with anyio.fail_after(TIMEOUT_S):
        reserved = await setup.memory.reserve(*blocks(["a", "b"]))
        fill(reserved, seed=2)
        reserved.release()
        reserved.release()
        fetched = await setup.memory.fetch(*blocks(["a", "b"]))
        fetched.release()
    assert fetched.outcomes == [MISSING, MISSING]
    assert setup.store.stats().keys == 0
    assert setup.pool.free_slots("save") == 3 and setup.pool.free_slots("load") == 1


async def test_a_key_stored_already_ends_present_and_keeps_its_bytes(setup: Setup) -> None:
    """Saving a stored key again is reported present, whether the memory learns it at
    reservation (lent) or from the store's put (staging), and the first bytes stay."""
    with anyio.fail_after(TIMEOUT_S):
        first = await setup.memory.reserve(*blocks(["k"]))
        kept = fill(first, seed=3)
        await setup.memory.store(first)
        again = await setup.memory.reserve(*blocks(["k", "new"]))
        if views_at(again.runs, 2)[0] is None:  # known at reservation: no memory for it
            assert again.outcomes[0] == PRESENT
            final = [PRESENT, *await setup.memory.store(again)]
        else:
            fill(again, seed=4)
            final = await setup.memory.store(again)
        fetched = await setup.memory.fetch(*blocks(["k"]))
    assert final == [PRESENT, STORED]
    view = views_at(fetched.runs, 1)[0]
    assert view is not None and torch.equal(view, kept[0])
    fetched.release()


async def test_a_closed_store_gives_one_failure_per_key_and_raises_nothing(
    setup: Setup,
) -> None:
    """A fetch from a store that is down fails every key with the store's reason."""
    await setup.store.aclose()
    with anyio.fail_after(TIMEOUT_S):
        fetched = await setup.memory.fetch(*blocks(["a", "b"]))
    fetched.release()
    assert [o.status for o in fetched.outcomes] == [BlockStatus.FAILED] * 2
    assert all(o.reason.startswith("store:") for o in fetched.outcomes)
    assert setup.pool.free_slots("load") == 1


async def test_staging_that_may_skip_refuses_a_save_when_no_slot_is_free() -> None:
    """With skip_when_full, a save finding every save slot taken gets no memory and
    says staging_full, without waiting."""
    store = EmbeddedStore(EmbeddedStoreConfig(capacity_bytes=1 << 16))
    pool = StagingPool(2 * 4096, 4096, load_slots=1)
    memory = StagingMemory(pool, store, skip_when_full=True)
    with anyio.fail_after(TIMEOUT_S):
        held = await memory.reserve(*blocks(["a"]))
        refused = await memory.reserve(*blocks(["b", "c"]))
    assert refused.runs == [] and refused.outcomes == [STAGING_FULL] * 2
    held.release()
    assert pool.free_slots("save") == 1
