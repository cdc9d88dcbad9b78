"""``KVSidecarConnector``: vLLM's KV connector for a kvsidecar.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVSidecarConnector",
      "kv_connector_module_path": "transport.vllm_connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"endpoint": "ipc:///run/kvsidecar.sock"}}'

``kv_role``: ``kv_both`` loads and saves, ``kv_consumer`` only loads, ``kv_producer``
only saves. The extra config is ``transport.vllm.config.ConnectorConfig``. Works with
vLLM 0.32 (the CPU build) and 0.33.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from transport.vllm.config import ConnectorConfig
from transport.vllm.layout import layout_from_vllm, store_namespace
from transport.vllm.plan import StepPlan
from transport.vllm.scheduler import SchedulerSide
from transport.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVSidecarConnector"]

log = structlog.get_logger("kvsidecar.vllm")


def _ranks(role: KVConnectorRole) -> dict[str, Any]:
    """This worker's ranks; the scheduler looks up as rank 0 of every kind."""
    if role is not KVConnectorRole.WORKER:
        return {}
    from vllm.distributed import parallel_state

    ranks: dict[str, Any] = {}
    for name, group in (("tp_rank", "get_tp_group"), ("pp_rank", "get_pp_group"),
                        ("dcp_rank", "get_dcp_group"), ("pcp_rank", "get_pcp_group")):
        getter = getattr(parallel_state, group, None)
        try:
            ranks[name] = int(getter().rank_in_group) if getter is not None else 0
        except (AssertionError, AttributeError):
            ranks[name] = 0  # that parallel group is not set up: rank 0
    return ranks


def _sizes(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> dict[str, Any]:
    """The engine's parallel sizes and KV heads, and vLLM's store namespace: what vLLM's
    Mooncake store worker builds its keys from."""
    parallel = vllm_config.parallel_config
    sizes: dict[str, Any] = {
        "tp_size": int(parallel.tensor_parallel_size),
        "pp_size": int(parallel.pipeline_parallel_size),
        "dcp_size": int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
        "pcp_world_size": int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
        "num_kv_heads": int(vllm_config.model_config.get_total_num_kv_heads()),
    }
    if config.store_tp_size is not None:
        resolve = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
        if resolve is None:
            raise ValueError("store_tp_size needs vLLM >= 0.33 (its resolved KV cache layout)")
        cache_layout = resolve()
        groups = kv_cache_config.kv_cache_groups
        sizes["store_namespace"] = store_namespace(
            config.store_tp_size, tp_size=sizes["tp_size"], pp_size=sizes["pp_size"],
            num_kv_heads=sizes["num_kv_heads"], cache_layout=cache_layout.name,
            tp_sharded=(
                sizes["pcp_world_size"] == 1 and sizes["dcp_size"] == 1 and len(groups) == 1
                and type(groups[0].kv_cache_spec).__name__ == "FullAttentionSpec"
                and cache_layout.name in ("LBHNC", "LBNHC")
            ),
        )
    return sizes


class KVSidecarConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        if kv_cache_config is None:
            raise ValueError("KVSidecarConnector needs vLLM's KVCacheConfig (vLLM >= 0.32)")
        cache = vllm_config.cache_config
        layout = layout_from_vllm(
            kv_cache_config, model=vllm_config.model_config.model,
            cache_prefix=config.cache_prefix, block_size=cache.block_size,
            **_sizes(vllm_config, kv_cache_config, config), **_ranks(role),
        )
        hash_algo = str(cache.prefix_caching_hash_algo)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute" and transfer.is_kv_consumer:
                log.warning("vllm.config.load_failures_fail_requests",
                            hint="set kv_load_failure_policy to 'recompute' so that vLLM "
                                 "recomputes blocks the sidecar cannot load")
            self._scheduler = SchedulerSide(
                config, layout, hash_algo=hash_algo,
                load=transfer.is_kv_consumer, save=transfer.is_kv_producer,
                num_blocks=kv_cache_config.num_blocks,
                workers=int(vllm_config.parallel_config.world_size),
            )
        else:
            self._worker = WorkerSide(config, layout, hash_algo=hash_algo,
                                      num_blocks=kv_cache_config.num_blocks)

    # -- scheduler side ---------------------------------------------------------------

    @property
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker"
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self._sched.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._sched.has_pending_push_work()

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request)

    # -- worker side ------------------------------------------------------------------

    @property
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler"
        return self._worker

    def _plan(self) -> StepPlan:
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan)
        return plan

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: no block this step's forward reads is being loaded.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # Saves go whole, after the forward (``wait_for_save``): one request per step.
        return

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._work.wait_for_save(self._plan())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        return None, self._work.transfer_results().finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._work.transfer_results()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work.saves_done()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- sleep mode (vLLM 0.33) ---------------------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # The sidecar maps vLLM's KV memory; sleep would free it under the mapping.
        return False
