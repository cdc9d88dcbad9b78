"""The vLLM connector against vLLM 0.33's own objects and a live sidecar.

``KVCacheConfig``s of the layouts kvsidecar exists for are converted and registered;
the scheduler side is driven with real ``Request`` and ``KVCacheBlocks`` objects, the
worker side with engine-allocated tensors, and the plan travels between them as vLLM
carries it. Only vLLM's scheduler loop itself is played by the test.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from pipeline.core.errors import LayoutError
from pipeline.core.layout import GroupKind
from pipeline.testing import SidecarProcess, run_sidecar_process
from tests.kit import random_tokens
from transport.vllm.layout import layout_from_vllm, store_namespace
from transport.vllm.plan import SavesDone, StepPlan
from transport.vllm_connector import KVSidecarConnector

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 24
POOL_BLOCKS = 4096
"""The test's vLLM block pool: it only counts references (block ids index the
tensors, and the test hands them out itself)."""
ATTN = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16}


def group(name: str, spec: kvi.KVCacheSpec, layers: int = 2) -> kvi.KVCacheGroupSpec:
    return kvi.KVCacheGroupSpec([f"model.layers.{name}.{i}" for i in range(layers)], spec)


def config_of(*groups: kvi.KVCacheGroupSpec, hash_block_size: int | None = None
              ) -> kvi.KVCacheConfig:
    return kvi.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                             kv_cache_groups=list(groups), hash_block_size=hash_block_size)


def mamba(block_size: int) -> kvi.MambaSpec:
    return kvi.MambaSpec(block_size=block_size, shapes=((4, 64), (8, 16, 16)),
                         dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align")


def qsa_hybrid(ring: int = 4) -> kvi.KVCacheConfig:
    """Qwen3-Next style: full attention 800, the QSA ring (4, or 8 with MTP), Mamba 800."""
    return config_of(
        group("full", kvi.FullAttentionSpec(block_size=800, **ATTN)),
        group("ring", kvi.CircularBufferSpec(block_size=ring, **ATTN)),
        group("mamba", mamba(800)),
    )


def gdn_hybrid() -> kvi.KVCacheConfig:
    """Qwen3-Next as vLLM builds it: GDN state padded to the attention page (640 tokens
    of one KV head of 64), and attention at the block size vLLM raised to match."""
    attention = kvi.FullAttentionSpec(block_size=640, **ATTN)
    state = kvi.MambaSpec(block_size=640, shapes=((3, 384), (2, 128, 128)),
                          dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align",
                          page_size_padded=attention.page_size_bytes)
    return config_of(group("linear_attn", state), group("full", attention))


CONFIGS = {
    "qsa_hybrid": qsa_hybrid(4),
    "gdn_hybrid": gdn_hybrid(),
    "qsa_hybrid_mtp": qsa_hybrid(8),
    "dense": config_of(group("full", kvi.FullAttentionSpec(block_size=32, **ATTN), 3)),
    "sliding_window_hybrid": config_of(
        group("swa", kvi.SlidingWindowSpec(block_size=32, sliding_window=64, **ATTN)),
        group("full", kvi.FullAttentionSpec(block_size=32, **ATTN)),
    ),
    "mla": config_of(group("mla", kvi.MLAAttentionSpec(
        block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))),
}


def engine_tensors(config: kvi.KVCacheConfig) -> dict[str, torch.Tensor]:
    """What vLLM allocates: one blocks-first tensor per layer, ring included; a padded
    Mamba page is registered as vLLM's CPU worker does, its state without the padding."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for g in config.kv_cache_groups:
        spec = g.kv_cache_spec
        for layer in g.layer_names:
            pages = torch.randint(0, 256, (NUM_BLOCKS, spec.page_size_bytes),
                                  dtype=torch.uint8, generator=gen)
            if isinstance(spec, kvi.MambaSpec):
                pages = pages[:, : spec.state_content_size_bytes]
            tensors[layer] = pages
    return tensors


def vllm_config(endpoint: str, *, hash_algo: str = "sha256", block_size: int = 32,
                tp_size: int = 1, num_kv_heads: int = 4, **extra: Any) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1,
                                        world_size=tp_size,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVSidecarConnector", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"endpoint": endpoint, "lookup_wait_ms": 50, **extra},
        ),
        model_config=SimpleNamespace(model="/models/tiny-hybrid",
                                     get_total_num_kv_heads=lambda: num_kv_heads),
        cache_config=SimpleNamespace(block_size=block_size, prefix_caching_hash_algo=hash_algo),
    )


@pytest.fixture(scope="module")
def sidecar() -> Iterator[SidecarProcess]:
    with run_sidecar_process() as process:
        yield process


# -- conversion --------------------------------------------------------------------------


def test_qsa_hybrid_converts_with_the_ring_never_stored() -> None:
    """The ring (4, or 8 with MTP) is a kv-cache group of its own that no store group names."""
    for ring in (4, 8):
        layout = layout_from_vllm(qsa_hybrid(ring), model="/models/Qwen3-Next")
        assert [g.kind for g in layout.groups] == [
            GroupKind.FULL_ATTENTION, GroupKind.CIRCULAR_BUFFER, GroupKind.MAMBA]
        assert layout.groups[1].block_size == ring
        assert layout.prefix_cacheable_group_ids == qsa_hybrid(ring).prefix_cacheable_group_ids
        assert layout.prefix_cacheable_group_ids == (0, 2)
        assert layout.groups[2].mamba_cache_mode == "align"
        assert layout.hash_block_size == 800
        assert layout.model == "Qwen3-Next"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_layout_converts_with_vllm_projections_and_pages(name: str) -> None:
    """Projections equal vLLM's own, and each group carries its spec's page size (a
    padded Mamba page: the state in it)."""
    config = CONFIGS[name]
    layout = layout_from_vllm(config, model="m")
    assert layout.transfer_group_ids == config.transfer_group_ids
    assert layout.prefix_cacheable_group_ids == config.prefix_cacheable_group_ids
    for ours, theirs in zip(layout.groups, config.kv_cache_groups, strict=True):
        spec = theirs.kv_cache_spec
        stored = (spec.state_content_size_bytes if isinstance(spec, kvi.MambaSpec)
                  else spec.page_size_bytes)
        assert ours.page_bytes == stored
        assert list(ours.layers) == theirs.layer_names


def test_vllm_hash_block_size_wins() -> None:
    """Fine hashes follow the engine's resolved hash_block_size, not a recomputed one."""
    config = config_of(group("full", kvi.FullAttentionSpec(block_size=64, **ATTN)),
                       group("swa", kvi.SlidingWindowSpec(block_size=64, sliding_window=96,
                                                          **ATTN)),
                       hash_block_size=16)
    assert layout_from_vllm(config, model="m").hash_block_size == 16


@pytest.mark.parametrize("spec", [
    kvi.CrossAttentionSpec(block_size=32, **ATTN),
    kvi.EncoderOnlyAttentionSpec(block_size=32, **ATTN),
])
def test_cross_attention_and_encoder_only_groups_are_refused(spec: kvi.KVCacheSpec) -> None:
    config = config_of(group("full", kvi.FullAttentionSpec(block_size=32, **ATTN)),
                       group("enc", spec))
    with pytest.raises(LayoutError, match=r"group 1: .*cannot be stored by prefix"):
        layout_from_vllm(config, model="m")


def test_a_mamba_group_not_in_align_mode_is_refused() -> None:
    spec = kvi.MambaSpec(block_size=32, shapes=((4, 64),), dtypes=(torch.float32,),
                         mamba_cache_mode="all")
    config = config_of(group("full", kvi.FullAttentionSpec(block_size=32, **ATTN)),
                       group("mamba", spec))
    with pytest.raises(LayoutError, match="group 1: mamba_cache_mode='all' != 'align'"):
        layout_from_vllm(config, model="m")


# -- registration ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_layout_registers_with_a_live_sidecar(name: str, sidecar: SidecarProcess) -> None:
    """Worker and scheduler register; only stored groups' tensors are shared, in place."""
    config = CONFIGS[name]
    tensors = engine_tensors(config)
    before = {layer: t.clone() for layer, t in tensors.items()}
    worker = KVSidecarConnector(vllm_config(sidecar.endpoint), KVConnectorRole.WORKER, config)
    scheduler = KVSidecarConnector(vllm_config(sidecar.endpoint), KVConnectorRole.SCHEDULER,
                                   config)
    try:
        worker.register_kv_caches(tensors)
        assert worker._work.link is not None
        registered = worker._work.link.wait_connected(10)
        assert registered is not None and registered.registered is not None
        assert registered.registered.store_group_ids == config.prefix_cacheable_group_ids
        assert scheduler._sched.link.wait_connected(10) is not None
        stored = {layer for gid in config.prefix_cacheable_group_ids
                  for layer in config.kv_cache_groups[gid].layer_names}
        for layer, tensor in tensors.items():
            assert tensor.is_shared() == (layer in stored), layer
            assert torch.equal(tensor, before[layer])  # moved in place, bytes kept
    finally:
        worker.shutdown()
        scheduler.shutdown()


# -- a request's life: saved by one engine, loaded by the next ---------------------------


class Engine:
    """One vLLM engine's two connector sides and the bits of vLLM's loop around them."""

    def __init__(self, endpoint: str, config: kvi.KVCacheConfig, hash_algo: str,
                 pool_blocks: int = POOL_BLOCKS, **extra: Any) -> None:
        self.config = config
        self.tensors = engine_tensors(config)
        self.block_ids: dict[str, tuple[list[int], ...]] = {}
        self.reported: dict[str, set[str]] = {"finished_recving": set()}
        """Every request the worker reported in each field, from any step: a transfer may
        finish within the step that started it, as vLLM's loop sees too."""
        self.pool = BlockPool(pool_blocks, enable_caching=False, hash_block_size=32)
        self.next_block = [1] * len(config.kv_cache_groups)
        self.worker = KVSidecarConnector(vllm_config(endpoint, hash_algo=hash_algo, **extra),
                                         KVConnectorRole.WORKER, config)
        self.worker.register_kv_caches(self.tensors)
        self.scheduler = KVSidecarConnector(vllm_config(endpoint, hash_algo=hash_algo, **extra),
                                            KVConnectorRole.SCHEDULER, config)
        self.scheduler.bind_kv_cache_manager(SimpleNamespace(
            get_block_ids=lambda req_id: self.block_ids[req_id], block_pool=self.pool))
        assert self.scheduler._sched.link.wait_connected(10) is not None

    def allocate(self, req_id: str, num_tokens: int) -> KVCacheBlocks:
        ids = []
        for gid, g in enumerate(self.config.kv_cache_groups):
            count = 1 if isinstance(g.kv_cache_spec, kvi.CircularBufferSpec) else (
                -(-num_tokens // g.kv_cache_spec.block_size))
            ids.append(list(range(self.next_block[gid], self.next_block[gid] + count)))
            self.next_block[gid] += count
        self.block_ids[req_id] = tuple(ids)
        return KVCacheBlocks(tuple([KVCacheBlock(i) for i in group] for group in ids))

    def allocate_from_pool(self, req_id: str, num_tokens: int | None = None) -> KVCacheBlocks:
        """Blocks as vLLM hands them out: from the pool, for each group in turn (None:
        every free block, to the first group)."""
        groups: list[list[KVCacheBlock]] = []
        for g in self.config.kv_cache_groups:
            if num_tokens is None:
                count = self.pool.get_num_free_blocks() if not groups else 0
            else:
                count = -(-num_tokens // g.kv_cache_spec.block_size)
            groups.append(self.pool.get_new_blocks(count))
        self.block_ids[req_id] = tuple([b.block_id for b in group] for group in groups)
        return KVCacheBlocks(tuple(groups))

    def lookup(self, request: Request) -> tuple[int, bool]:
        deadline = time.monotonic() + 10
        while True:
            tokens, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
            if tokens is not None:
                return tokens, is_async
            assert time.monotonic() < deadline, "the lookup never came back"

    def step(self, scheduled: dict[str, int], finished: AbstractSet[str] = frozenset(),
             preempted: AbstractSet[str] = frozenset()) -> Any:
        output = SimpleNamespace(num_scheduled_tokens=scheduled, preempted_req_ids=preempted,
                                 scheduled_spec_decode_tokens={}, finished_req_ids=finished)
        plan = self.scheduler.build_connector_meta(output)
        assert isinstance(plan, StepPlan)
        self.worker.handle_preemptions(plan)
        self.worker.bind_connector_metadata(plan)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(set(finished))
        saves_done = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        for field, reported in self.reported.items():
            reported |= getattr(results, field)
        self.scheduler.update_connector_output(SimpleNamespace(
            finished_recving=results.finished_recving, finished_sending=None,
            kv_connector_worker_meta=saves_done))
        return plan, results

    def held_blocks(self) -> int:
        """Blocks the scheduler side holds out of the pool for saves in flight."""
        return self.scheduler._sched._held_blocks

    def until_saved(self) -> None:
        """Step until every save is over, and its blocks are back in the pool."""
        deadline = time.monotonic() + 10
        while self.held_blocks():
            assert time.monotonic() < deadline, "the saves never ended"
            time.sleep(0.01)
            self.step({})

    def until(self, field: str, req_id: str, finished: AbstractSet[str] = frozenset()) -> None:
        deadline = time.monotonic() + 10
        while True:
            self.step({}, finished)
            if req_id in self.reported[field]:
                return
            assert time.monotonic() < deadline, f"{req_id} never in {field}"
            time.sleep(0.01)
            finished = frozenset()  # vLLM names a finished request once

    def pages(self, req_id: str, gid: int) -> list[torch.Tensor]:
        layers = self.config.kv_cache_groups[gid].layer_names
        return [self.tensors[layer][b].clone() for layer in layers
                for b in self.block_ids[req_id][gid]]

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def request(req_id: str, prompt: list[int], hash_block_size: int, algo: str,
            **extra: Any) -> Request:
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    return Request(req_id, prompt, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(hash_block_size, hash_fn), **extra)


def test_lora_salt_and_multimodal_keys_reach_the_store_as_vllm_hashed_them(
    sidecar: SidecarProcess,
) -> None:
    """With sha256_cbor the sidecar checks vLLM's first hash against the tokens and the
    request's keys: they must arrive as vLLM put them into it. Other keys, other blocks."""
    init_none_hash(get_hash_fn_by_name("sha256_cbor"))
    config = CONFIGS["dense"]
    prompt = random_tokens(200, seed=8)
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier="img-1",
                                      mm_position=PlaceholderRange(offset=40, length=30))]
    keyed = {"lora_request": LoRARequest("sql", 1, "/adapters/sql"), "cache_salt": "tenant-a",
             "mm_features": features}
    a = Engine(sidecar.endpoint, config, "sha256_cbor")
    b = Engine(sidecar.endpoint, config, "sha256_cbor")
    try:
        req = request("k-1", prompt, 32, "sha256_cbor", **keyed)
        assert a.lookup(req) == (0, False)
        a.scheduler.update_state_after_alloc(req, a.allocate("k-1", 200), 0)
        a.step({"k-1": 200})
        a.scheduler.request_finished_all_groups(req, a.block_ids["k-1"])
        a.until_saved()
        assert b.lookup(request("k-2", prompt, 32, "sha256_cbor", **keyed)) == (192, True)
        assert b.lookup(request("k-3", prompt, 32, "sha256_cbor")) == (0, False)
        salted = {**keyed, "cache_salt": "tenant-b"}
        assert b.lookup(request("k-4", prompt, 32, "sha256_cbor", **salted)) == (0, False)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("name", "algo", "prompt_tokens"), [
    ("dense", "sha256", 200),
    ("dense", "sha256_cbor", 200),
    ("sliding_window_hybrid", "sha256", 300),
    ("qsa_hybrid", "sha256", 2500),
    ("gdn_hybrid", "sha256", 1300),
    ("mla", "xxhash", 100),
])
def test_a_prompt_saved_by_one_engine_loads_byte_exactly_into_another(
    name: str, algo: str, prompt_tokens: int, sidecar: SidecarProcess, monkeypatch: Any
) -> None:
    """Engine A computes and saves a prompt; engine B looks it up with its own request's
    vLLM hashes, loads it asynchronously, and holds A's bytes in every needed block."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # xxhash shares hashes across processes only so
    init_none_hash(get_hash_fn_by_name(algo))  # as vLLM's engine core does before its scheduler
    config = CONFIGS[name]
    layout = layout_from_vllm(config, model="m")
    hbs = layout.hash_block_size
    prompt = random_tokens(prompt_tokens, seed=hash(name) % 1000)
    a, b = Engine(sidecar.endpoint, config, algo), Engine(sidecar.endpoint, config, algo)
    try:
        req_a = request("a-1", prompt, hbs, algo)
        assert a.lookup(req_a) == (0, False)
        a.scheduler.update_state_after_alloc(req_a, a.allocate("a-1", prompt_tokens), 0)
        plan, _ = a.step({"a-1": prompt_tokens})
        assert [s.request_id for s in plan.saves] == ["a-1"]
        # Its finish is not delayed: the save holds the blocks it reads.
        assert a.scheduler.request_finished_all_groups(req_a, a.block_ids["a-1"]) == (False, None)
        assert not a.scheduler.has_pending_block_frees()
        a.until_saved()

        req_b = request("b-1", prompt, hbs, algo)
        hit, is_async = b.lookup(req_b)
        expected = (prompt_tokens - 1) // layout.lookup_alignment * layout.lookup_alignment
        assert (hit, is_async) == (expected, True)
        b.scheduler.update_state_after_alloc(req_b, b.allocate("b-1", prompt_tokens), hit)
        plan, _ = b.step({})
        assert [(load.request_id, load.num_tokens) for load in plan.loads] == [("b-1", hit)]
        b.until("finished_recving", "b-1")
        assert b.worker.get_block_ids_with_load_errors() == set()
        for gid in config.prefix_cacheable_group_ids:
            spec = config.kv_cache_groups[gid].kv_cache_spec
            needed = range(hit // spec.block_size)
            if isinstance(spec, kvi.SlidingWindowSpec):
                needed = range(max(0, hit - spec.sliding_window + 1) // spec.block_size,
                               hit // spec.block_size)
            if isinstance(spec, kvi.MambaSpec):
                needed = range(hit // spec.block_size - 1, hit // spec.block_size)
            layers = config.kv_cache_groups[gid].layer_names
            for j in needed:
                for layer in layers:
                    assert torch.equal(b.tensors[layer][b.block_ids["b-1"][gid][j]],
                                       a.tensors[layer][a.block_ids["a-1"][gid][j]]), (gid, j)
        for gid in set(range(len(config.kv_cache_groups))) - set(
                config.prefix_cacheable_group_ids):
            ring = config.kv_cache_groups[gid].layer_names[0]
            assert not b.tensors[ring].is_shared()  # never registered, never written
    finally:
        a.close()
        b.close()


def test_a_sidecar_restart_under_running_engines_fails_softly_then_serves_again(
    tmp_path: Any,
) -> None:
    """Saves and lookups while the sidecar is gone are misses, reported, never hangs; a
    new sidecar on the same endpoint is re-registered with and serves loads again."""
    config = CONFIGS["dense"]
    prompt = random_tokens(200, seed=3)
    endpoint = f"ipc://{tmp_path}/sidecar.sock"
    on_endpoint = {"server": {"endpoint": endpoint}}
    with run_sidecar_process(on_endpoint):
        a = Engine(endpoint, config, "sha256", timeout_s=2, retry_after_s=1)
        b = Engine(endpoint, config, "sha256", timeout_s=2, retry_after_s=1)
    try:
        # The sidecar is gone: A's save fails, and is still reported over.
        req_a = request("a-1", prompt, 32, "sha256")
        started = time.monotonic()
        assert a.lookup(req_a) == (0, False)
        assert time.monotonic() - started < 5
        a.scheduler.update_state_after_alloc(req_a, a.allocate("a-1", 200), 0)
        a.step({"a-1": 200})
        assert not a.scheduler.request_finished_all_groups(req_a, a.block_ids["a-1"])[0]
        a.until_saved()
        with run_sidecar_process(on_endpoint):
            deadline = time.monotonic() + 20
            hit = 0
            while hit == 0:
                assert time.monotonic() < deadline, "the engines never came back"
                req = request(f"a-{time.monotonic()}", prompt, 32, "sha256")
                a.scheduler.update_state_after_alloc(req, a.allocate(req.request_id, 200), 0)
                a.step({req.request_id: 200})
                a.scheduler.request_finished_all_groups(req, a.block_ids[req.request_id])
                a.until_saved()
                hit, _ = b.lookup(request(f"b-{time.monotonic()}", prompt, 32, "sha256"))
                time.sleep(0.2)
            assert hit == 192
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("name", "prompt_tokens"), [("dense", 200),
                                                   ("sliding_window_hybrid", 300)])
def test_blocks_vllm_frees_while_their_save_runs_are_not_reused_and_no_forward_waits(
    name: str, prompt_tokens: int, monkeypatch: Any,
) -> None:
    """vLLM frees a save's blocks while the sidecar (stopped) has yet to read them: a
    preempted request's (dense), or those a sliding window moved past. The pool hands
    none of them to another request, the next forward does not wait, and every block
    it did hand out is overwritten at once; once the sidecar runs again, the save ends,
    its blocks return to the pool, and a second engine loads the bytes they held."""
    import os
    import signal

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(get_hash_fn_by_name("sha256"))
    config = CONFIGS[name]
    prompt = random_tokens(prompt_tokens, seed=31)
    with run_sidecar_process() as sidecar:
        a = Engine(sidecar.endpoint, config, "sha256", pool_blocks=NUM_BLOCKS, timeout_s=5)
        b = Engine(sidecar.endpoint, config, "sha256")
        try:
            req_a = request("a-1", prompt, 32, "sha256")
            assert a.lookup(req_a) == (0, False)
            blocks = a.allocate_from_pool("a-1", prompt_tokens)
            a.scheduler.update_state_after_alloc(req_a, blocks, 0)
            os.kill(sidecar.pid, signal.SIGSTOP)
            try:
                plan, _ = a.step({"a-1": prompt_tokens})
                (save,) = plan.saves
                held = {block for ids in save.block_ids for block in ids if block}
                saved = {layer: a.tensors[layer].clone() for layer in a.tensors}
                if name == "dense":  # preempted: vLLM frees all of its blocks
                    freed = [block for group in blocks.blocks for block in group]
                else:  # the window moved on: vLLM frees the blocks before it
                    freed = list(blocks.blocks[0][: (prompt_tokens - 64) // 32])
                a.pool.free_blocks(reversed(freed))
                reused = a.allocate_from_pool("c-1")  # all vLLM can hand out now
                assert held.isdisjoint(block.block_id for block in reused.blocks[0])
                started = time.monotonic()
                a.step({})  # the next forward: nothing to wait for
                waited = time.monotonic() - started
                for tensor in a.tensors.values():  # ... which writes every block it got
                    tensor[a.block_ids["c-1"][0]] = 0
            finally:
                os.kill(sidecar.pid, signal.SIGCONT)
            assert waited < 1.0, f"the forward waited {waited:.2f} s for the sidecar"
            assert a.held_blocks() == len(held)
            a.until_saved()
            freed_ids = {block.block_id for block in freed}  # back in the pool, or a-1's
            assert all(a.pool.blocks[block].ref_cnt == (block not in freed_ids)
                       for block in held)

            req_b = request("b-1", prompt, 32, "sha256")
            hit, _ = b.lookup(req_b)
            assert hit == prompt_tokens // 32 * 32
            b.scheduler.update_state_after_alloc(req_b, b.allocate("b-1", prompt_tokens), hit)
            b.step({})
            b.until("finished_recving", "b-1")
            assert b.worker.get_block_ids_with_load_errors() == set()
            window = range(max(0, hit - 64 + 1) // 32, hit // 32)
            for gid, g in enumerate(config.kv_cache_groups):
                swa = isinstance(g.kv_cache_spec, kvi.SlidingWindowSpec)
                for j, block in enumerate(save.block_ids[gid]):
                    if block and (j in window or not swa):  # what a load writes
                        for layer in g.layer_names:
                            assert torch.equal(b.tensors[layer][b.block_ids["b-1"][gid][j]],
                                               saved[layer][block]), (gid, j)
        finally:
            a.close()
            b.close()


def test_blocks_held_for_saves_are_bounded_and_a_save_past_the_bound_is_skipped(
    monkeypatch: Any,
) -> None:
    """A stopped sidecar answers no save: once ``pinned_fraction`` of the pool is held,
    further saves are skipped (counted), not planned; the held blocks come back when
    the sidecar answers."""
    import os
    import signal

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    init_none_hash(get_hash_fn_by_name("sha256"))
    with run_sidecar_process() as sidecar:
        a = Engine(sidecar.endpoint, CONFIGS["dense"], "sha256", timeout_s=5,
                   pinned_fraction=0.5)  # 12 of 24 blocks; each save here holds 6
        try:
            os.kill(sidecar.pid, signal.SIGSTOP)
            try:
                planned = []
                for i in range(3):
                    req = request(f"r-{i}", random_tokens(200, seed=40 + i), 32, "sha256")
                    a.scheduler.update_state_after_alloc(req, a.allocate(req.request_id, 200), 0)
                    plan, _ = a.step({req.request_id: 200})
                    planned.append(len(plan.saves))
            finally:
                os.kill(sidecar.pid, signal.SIGCONT)
            assert planned == [1, 1, 0]
            assert a.scheduler._sched.skipped_saves == 1
            assert a.held_blocks() == 12
            a.until_saved()
        finally:
            a.close()


def test_a_saves_blocks_are_held_until_every_worker_reports_it(sidecar: SidecarProcess) -> None:
    """At tensor parallel 2 each worker reads its own shard: the blocks go back to the
    pool only once both have reported the save over, as vLLM sums their reports."""
    engine = Engine(sidecar.endpoint, CONFIGS["dense"], "sha256")
    try:
        scheduler = KVSidecarConnector(vllm_config(sidecar.endpoint, tp_size=2),
                                       KVConnectorRole.SCHEDULER, CONFIGS["dense"])
        scheduler.bind_kv_cache_manager(SimpleNamespace(
            get_block_ids=lambda req_id: engine.block_ids[req_id], block_pool=engine.pool))
        req = request("t-1", random_tokens(100, seed=8), 32, "sha256")
        scheduler.update_state_after_alloc(req, engine.allocate("t-1", 100), 0)
        plan = scheduler.build_connector_meta(SimpleNamespace(
            num_scheduled_tokens={"t-1": 100}, scheduled_spec_decode_tokens={}))
        assert isinstance(plan, StepPlan)
        (save,) = plan.saves
        held = [engine.pool.blocks[block] for block in save.block_ids[0] if block]
        assert [block.ref_cnt for block in held] == [1, 1, 1]

        def report(*done: SavesDone | None) -> None:  # as vLLM sums what workers report
            merged = None
            for other in filter(None, done):
                merged = other if merged is None else merged.aggregate(other)
            scheduler.update_connector_output(SimpleNamespace(
                finished_recving=None, finished_sending=None, kv_connector_worker_meta=merged))

        report(SavesDone({save.save_id: 1}), None)  # one worker done, the other not yet
        assert [block.ref_cnt for block in held] == [1, 1, 1]
        assert scheduler.has_pending_push_work()  # vLLM steps on, idle or not
        report(None, SavesDone({save.save_id: 1, save.save_id + 7: 1}))
        assert [block.ref_cnt for block in held] == [0, 0, 0]
        assert not scheduler.has_pending_push_work()
        scheduler.shutdown()
    finally:
        engine.close()


def test_a_scheduler_just_started_defers_its_first_lookups_then_misses_without_a_sidecar(
    tmp_path: Any,
) -> None:
    """While the first connection is being made, a lookup is deferred (vLLM asks again)
    instead of missing; once that connection has failed, lookups miss at once, also
    while a later attempt is under way."""
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    scheduler = KVSidecarConnector(vllm_config(endpoint, connect_timeout_s=1, retry_after_s=0.2),
                                   KVConnectorRole.SCHEDULER, CONFIGS["dense"])
    try:
        req = request("r", random_tokens(100, seed=5), 32, "sha256")
        started = time.monotonic()
        answers = []
        while (answer := scheduler.get_num_new_matched_tokens(req, 0)) == (None, False):
            answers.append(answer)
            assert time.monotonic() - started < 5, "deferred past connect_timeout_s"
            time.sleep(0.05)
        assert answers, "the first lookup should wait for the link"
        assert answer == (0, False)
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        time.sleep(0.3)  # past retry_after_s: the next call starts another attempt
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    finally:
        scheduler.shutdown()


@pytest.mark.parametrize(("store_tp", "heads", "sharded", "expected"), [
    (None, 8, True, ""),
    (4, 8, False, "@store_pp:1@store_format:rank_local_tp2_layout_LBHNC"),
    (4, 1, True, "@store_pp:1@store_format:tp_shared_mqa"),
    (1, 8, True, "@store_pp:1@store_format:rank_local_tp2_layout_LBHNC"),
])
def test_store_tp_size_gives_vllms_store_namespace(
    store_tp: int | None, heads: int, sharded: bool, expected: str
) -> None:
    """store_tp_size names the namespace vLLM's Mooncake store worker picks: none when
    unset, the MQA one for one KV head, else the rank-local one for the cache layout."""
    assert store_namespace(store_tp, tp_size=2, pp_size=1, num_kv_heads=heads,
                           cache_layout="LBHNC", tp_sharded=sharded) == expected


def test_a_store_tp_size_vllm_would_shard_is_refused() -> None:
    """Where vLLM would store TP-sharded values, kvsidecar refuses instead of writing
    rank-local ones under keys vLLM reads otherwise."""
    with pytest.raises(LayoutError, match="TP-sharded"):
        store_namespace(4, tp_size=2, pp_size=1, num_kv_heads=8, cache_layout="LBHNC",
                        tp_sharded=True)


@pytest.mark.parametrize("policy", ["fail", "continue"])
def test_a_kv_cache_the_sidecar_refuses_stops_the_engine_unless_asked_to_go_on(
    policy: str, sidecar: SidecarProcess,
) -> None:
    """Tensors the layout does not describe (here each GDN layer registered with its
    padding) are refused by the sidecar: by default the worker's registration fails at
    start-up naming the group and the reason; with ``continue`` the engine runs on
    without the sidecar, which is not asked again."""
    config = CONFIGS["gdn_hybrid"]
    gen = torch.Generator().manual_seed(0)
    tensors = {layer: torch.randint(0, 256, (NUM_BLOCKS, g.kv_cache_spec.page_size_bytes),
                                    dtype=torch.uint8, generator=gen)
               for g in config.kv_cache_groups for layer in g.layer_names}
    worker = KVSidecarConnector(vllm_config(sidecar.endpoint, on_refused_layout=policy),
                                KVConnectorRole.WORKER, config)
    try:
        if policy == "fail":
            with pytest.raises(LayoutError, match=re.escape(
                    "bad_tensors: group 0: layer 'model.layers.linear_attn.0'")):
                worker.register_kv_caches(tensors)
        else:
            started = time.monotonic()
            worker.register_kv_caches(tensors)
            assert time.monotonic() - started < 5  # not retried until connect_timeout_s
            link = worker._work.link
            assert link is not None and link.refused is not None
            assert link.client() is None
    finally:
        worker.shutdown()


def test_saves_a_step_could_not_send_are_reported_over(
    sidecar: SidecarProcess, monkeypatch: Any,
) -> None:
    """A save that fails to be sent, and the step's saves after it, never reach the
    sidecar: they are reported over at once, so their blocks go back to the pool."""
    engine = Engine(sidecar.endpoint, CONFIGS["dense"], "sha256")
    try:
        for req_id in ("s-1", "s-2"):
            req = request(req_id, random_tokens(100, seed=len(req_id) + int(req_id[-1])),
                          32, "sha256")
            engine.scheduler.update_state_after_alloc(req, engine.allocate(req_id, 100), 0)
        plan = engine.scheduler.build_connector_meta(SimpleNamespace(
            num_scheduled_tokens={"s-1": 100, "s-2": 100}, scheduled_spec_decode_tokens={}))
        assert isinstance(plan, StepPlan) and len(plan.saves) == 2
        assert engine.held_blocks() == 6
        client = engine.worker._work.link.client()  # type: ignore[union-attr]

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the socket is gone")

        monkeypatch.setattr(client, "start_save", refuse)
        engine.worker.bind_connector_metadata(plan)
        with pytest.raises(RuntimeError):
            engine.worker.wait_for_save()
        engine.worker.clear_connector_metadata()
        done = engine.worker.build_connector_worker_meta()
        assert isinstance(done, SavesDone)
        assert done.reports == {save.save_id: 1 for save in plan.saves}
        engine.scheduler.update_connector_output(SimpleNamespace(
            finished_recving=None, finished_sending=None, kv_connector_worker_meta=done))
        assert engine.held_blocks() == 0
    finally:
        engine.close()
