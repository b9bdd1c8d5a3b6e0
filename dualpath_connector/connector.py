"""``DualPathConnector``: the vLLM ``KVConnectorBase_V1`` facade.

It validates the configuration once and dispatches each hook to the scheduler
half (:mod:`dualpath_connector.scheduler.scheduler`) or the worker half
(:mod:`dualpath_connector.worker.worker`); it holds no logic of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from dualpath_connector.config import check_parallel, expected_kv_cache_layout, parse_config, waits_per_layer
from dualpath_connector.metadata import DualPathMetadata, SavedChunks
from dualpath_connector.metrics.stats import DualPathPromMetrics, DualPathStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class DualPathConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv_role = self._kv_transfer_config.kv_role
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            # Sliding-window groups pad skipped blocks with vLLM's shared null block.
            raise ValueError("DualPathConnector supports models with one full-attention KV cache group")
        self.config = parse_config(self._kv_transfer_config.kv_connector_extra_config, kv_role)
        check_parallel(vllm_config.parallel_config, self.config, kv_role)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from dualpath_connector.scheduler.scheduler import DualPathScheduler

            self._scheduler = DualPathScheduler.from_vllm(vllm_config, self.config, kv_role)
        else:
            from dualpath_connector.worker.worker import DualPathWorker

            self._worker = DualPathWorker(vllm_config, self.config, kv_role)

    @property
    def requires_kv_delivery(self) -> bool:
        # A PE hands prompts off to its DE; otherwise this is a cache, and a
        # dropped save is only a future miss.
        return self._kv_transfer_config.kv_role == "kv_producer"

    # -- worker side ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name, self._meta())

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Completed chunks are copied out once per step, in wait_for_save.
        return

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> DualPathStats | None:
        # Both halves count: vLLM asks the scheduler's connector too and merges the two.
        return self._worker.get_stats() if self._worker else self._scheduler.get_stats()

    def build_connector_worker_meta(self) -> SavedChunks | None:
        return self._worker.take_saved_chunks()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _meta(self) -> DualPathMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMetadata)
        return meta

    # -- scheduler side -------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        return self._scheduler.hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self._scheduler.update_connector_output(connector_output.invalid_block_ids)
        self._scheduler.saves_finished(connector_output.kv_connector_worker_meta)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events()

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    # -- class-level hooks ----------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # The layout is part of the store namespace, which every process must
        # derive alike, so it is fixed by configuration rather than left to the backend.
        kv_transfer = vllm_config.kv_transfer_config
        return expected_kv_cache_layout(parse_config(kv_transfer.kv_connector_extra_config, kv_transfer.kv_role))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks before ``--enable-sleep-mode`` (0.32 never does): no, in every role. The worker keeps
        tensor views of the KV cache (loads copy into it, saves out of it) and, in a PD role, a NIXL registration
        of it that peers READ; after a wake-up those would name memory vLLM remapped. Refusing makes vLLM stop at
        start-up with its own error instead of serving KV from the wrong memory."""
        logger.warning("DualPathConnector does not support vLLM's sleep mode: its KV cache views and NIXL "
                       "registration would outlive the remapped KV cache; start without --enable-sleep-mode")  # fmt: skip
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM then turns FULL_AND_PIECEWISE into PIECEWISE: the per-layer waits run between graph pieces.
        return waits_per_layer(extra_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DualPathStats:
        return DualPathStats(data=data) if data is not None else DualPathStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> DualPathPromMetrics:
        return DualPathPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
