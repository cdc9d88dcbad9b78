"""The connector in vLLM's engine-core process: lookups, and each step's plan.

Lookups use the request's own vLLM block hashes, so whatever ``prefix_caching_hash_algo``
the engine uses, keys are the engine's. A lookup never holds the scheduler: it waits
``lookup_wait_ms`` at most, then vLLM is told to ask again next step (``None``).

Loads are asynchronous in vLLM's sense: the request waits (``WAITING_FOR_REMOTE_KVS``)
while the worker loads into its freshly allocated blocks, and is scheduled once the
load is reported. A failed load is reported per request, so vLLM recomputes; that is
the one failure path vLLM supports for hybrid (several-group) layouts.

A finished request whose load is in flight keeps its blocks until the worker reports
the load (``request_finished_all_groups`` returns True exactly then).

A save's blocks are held out of vLLM's free pool while the sidecar may read them: the
plan takes a reference on each (``BlockPool.touch``), and drops it once every worker
has reported the save over (``SavesDone``). vLLM may free them meanwhile, as a request
finishes or is preempted, a sliding window moves on, or Mamba state is superseded, but
cannot hand them to another request, so no forward ever waits on the sidecar and no
save reads a block being rewritten. Held blocks are bounded by ``pinned_fraction`` of
the pool: past it a save is skipped (a cache fill lost, logged and counted), so a
stalled sidecar holds a bounded share of the engine's blocks.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import structlog

from pipeline.core.errors import RequestRejected, TransportError
from pipeline.core.layout import KVCacheLayout
from transport.client import InlineLookupClient, PendingLookup
from transport.vllm.config import ConnectorConfig
from transport.vllm.layout import request_keys, vllm_block_hasher
from transport.vllm.link import SidecarLink
from transport.vllm.plan import LoadPlan, SavePlan, SavesDone, StepPlan

__all__ = ["SchedulerSide", "prefix"]

log = structlog.get_logger("kvsidecar.vllm")


def prefix(request: Any, tokens: int, hash_block_size: int) -> tuple[list[int], list[bytes]]:
    """The request's first ``tokens`` tokens and their vLLM block hashes; cut to the
    hashed blocks where vLLM has not hashed that far (lookahead tokens)."""
    hashes = request.block_hashes
    full = tokens // hash_block_size
    if len(hashes) < full:
        full = len(hashes)
        tokens = full * hash_block_size
    return list(request.all_token_ids[:tokens]), [bytes(h) for h in hashes[:full]]


@dataclasses.dataclass(slots=True)
class _Tracked:
    request: Any
    saved_tokens: int = 0
    """Tokens whose full blocks have been planned for saving (or skipped)."""


@dataclasses.dataclass(slots=True)
class _Held:
    blocks: list[Any]
    """vLLM's ``KVCacheBlock``s of one save, each referenced once by it."""
    reports: int = 0


class SchedulerSide:
    def __init__(
        self, config: ConnectorConfig, layout: KVCacheLayout, *, hash_algo: str,
        load: bool, save: bool, num_blocks: int, workers: int,
    ) -> None:
        """``num_blocks``: vLLM's KV block pool; ``workers``: how many workers report
        each save (vLLM's world size)."""
        self._config = config
        self._layout = layout
        self._hbs = layout.hash_block_size
        self._load = load
        self._save = save
        self._stored = set(layout.prefix_cacheable_group_ids)
        self._requests: dict[str, _Tracked] = {}
        self._lookups: dict[str, PendingLookup] = {}
        self._matched: dict[str, int] = {}
        """Request -> the engine's own hit its lookup was answered for."""
        self._planned_loads: list[LoadPlan] = []
        self._loading: set[str] = set()
        self._delayed: set[str] = set()
        """Finished requests whose blocks wait for the worker's word."""
        self._block_ids: Any = None  # the KV cache manager's get_block_ids, once bound
        self._pool: Any = None  # and its BlockPool
        self._workers = workers
        self._held: dict[int, _Held] = {}
        """Saves in flight by ``save_id``, with the blocks they hold."""
        self._held_blocks = 0
        self._hold_limit = int(config.pinned_fraction * num_blocks)
        self._next_save_id = 0
        self.skipped_saves = 0
        """Saves not made: too many blocks were held for saves in flight."""
        # Lookups wait in this thread, vLLM's scheduler's, with no hop to another.
        self.link = SidecarLink(config, "scheduler", InlineLookupClient, lambda: {
            "layout": layout,
            "hash_algo": hash_algo,
            "hash_seed": os.environ.get("PYTHONHASHSEED"),
            "block_hasher": vllm_block_hasher(hash_algo),
            "engine_id": f"vllm-scheduler-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            # Never past the scheduler's wait: a poll holds the thread it runs in.
            "lookup_spin_s": min(config.lookup_spin_ms, config.lookup_wait_ms) / 1000,
        })
        if load:
            self.link.client()  # start connecting now, not at the first request

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM's cache manager: the blocks of each request, and the pool saves hold
        blocks of (no save is planned before this)."""
        self._block_ids = kv_cache_manager.get_block_ids
        self._pool = kv_cache_manager.block_pool

    # -- lookups ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        self._requests.setdefault(req_id, _Tracked(request))
        if not self._load:
            return 0, False
        pending = self._lookups.get(req_id)
        if pending is None:
            client = self.link.client()
            if client is None:
                # Just started: ask again next step rather than miss the first requests
                # (bounded by connect_timeout_s; a sidecar that fails is skipped at once).
                return (None, False) if self.link.starting else (0, False)
            tokens, hashes = prefix(request, request.num_tokens, self._hbs)
            pending = self._lookups[req_id] = client.start_lookup(
                tokens, block_hashes=hashes, request_id=req_id,
                timeout_s=self._config.lookup_timeout_s, **request_keys(request),
            )
        try:
            hit = pending.result(timeout=self._config.lookup_wait_ms / 1000)
        except FutureTimeout:
            return None, False  # not answered yet: vLLM asks again next step
        except TransportError as exc:
            self.link.failed(exc)
            hit = 0
        except RequestRejected as exc:
            log.warning("vllm.lookup.refused", request_id=req_id, error=str(exc))
            hit = 0
        finally:
            if pending.done():
                del self._lookups[req_id]
        extra = hit - num_computed_tokens
        if extra <= 0 or extra < self._config.min_load_tokens:
            return 0, False
        self._matched[req_id] = num_computed_tokens
        return extra, True

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._requests.setdefault(req_id, _Tracked(request))
        computed = self._matched.pop(req_id, None)
        if num_external_tokens == 0 or computed is None:
            return
        end = computed + num_external_tokens
        tokens, hashes = prefix(request, end, self._hbs)
        # What is loaded is in the store already: saves start after it.
        tracked = self._requests[req_id]
        tracked.saved_tokens = max(tracked.saved_tokens, end)
        self._planned_loads.append(LoadPlan(
            req_id, tokens, hashes, self._only_stored(blocks.get_block_ids()),
            request_keys(request), num_tokens=end, computed_tokens=computed,
        ))

    # -- the step's plan ----------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan(loads=self._planned_loads)
        self._planned_loads = []
        self._loading.update(load.request_id for load in plan.loads)
        if self._save and self._pool is not None:
            spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
            for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                tracked = self._requests.get(req_id)
                if tracked is not None:
                    drafts = len(spec.get(req_id, ()))  # their KV may be rejected
                    done = tracked.request.num_computed_tokens + scheduled - drafts
                    save = self._plan_save(tracked, done)
                    if save is not None:
                        plan.saves.append(save)
        return plan

    def _plan_save(self, tracked: _Tracked, done: int) -> SavePlan | None:
        """The blocks that become full in this step, if any (earlier ones were planned)."""
        request = tracked.request
        full = min(done // self._hbs, len(request.block_hashes)) * self._hbs
        if full <= tracked.saved_tokens:
            return None
        block_ids = self._block_ids(request.request_id)
        planned: list[list[int]] = []
        for group_id, (group, ids) in enumerate(zip(self._layout.groups, block_ids, strict=True)):
            first = tracked.saved_tokens // group.block_size
            last = full // group.block_size
            if group_id not in self._stored or last <= first:
                planned.append([])
                continue
            # Blocks already planned are left out (0); dedup would skip them anyway.
            planned.append([0] * first + list(ids[first:last]))
        tracked.saved_tokens = full
        held = [self._pool.blocks[block] for ids in planned for block in ids if block]
        if not held:
            return None
        if self._held_blocks and self._held_blocks + len(held) > self._hold_limit:
            self.skipped_saves += 1
            log.warning("vllm.save.skipped", request_id=request.request_id,
                        held_blocks=self._held_blocks, skipped_saves=self.skipped_saves,
                        reason="pinned_fraction of the engine's blocks are held for saves "
                               "the sidecar has not answered")
            return None
        self._pool.touch(held)
        save_id = self._next_save_id
        self._next_save_id += 1
        self._held[save_id] = _Held(held)
        self._held_blocks += len(held)
        tokens, hashes = prefix(request, full, self._hbs)
        return SavePlan(request.request_id, tokens, hashes, tuple(planned),
                        request_keys(request), save_id=save_id)

    def _only_stored(self, block_ids: Any) -> tuple[list[int], ...]:
        # Groups that are never stored (the ring) travel empty.
        return tuple(
            list(ids) if group_id in self._stored else []
            for group_id, ids in enumerate(block_ids)
        )

    # -- completions --------------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            self._delayed.discard(req_id)
        done = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(done, SavesDone):
            for save_id, count in done.reports.items():
                held = self._held.get(save_id)
                if held is None:
                    continue
                held.reports += count
                if held.reports >= self._workers:
                    del self._held[save_id]
                    self._held_blocks -= len(held.blocks)
                    self._pool.free_blocks(reversed(held.blocks))

    def has_pending_block_frees(self) -> bool:
        """Finished requests' blocks the worker will free soon (vLLM may wait for them
        rather than preempt). Blocks held for saves are not counted: a stalled sidecar
        would hold vLLM's scheduling with them."""
        return bool(self._delayed)

    def has_pending_push_work(self) -> bool:
        """Blocks are held for saves: vLLM keeps stepping, idle or not, since a save's
        end reaches this side only with a step's output."""
        return bool(self._held)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._matched.pop(req_id, None)
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None:
            lookup.cancel()
        delay = req_id in self._loading
        if delay:
            self._delayed.add(req_id)
        return delay, None

    def shutdown(self) -> None:
        self.link.close()
