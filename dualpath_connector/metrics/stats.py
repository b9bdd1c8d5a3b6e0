"""Connector stats: collected by the worker half, aggregated and exported by vLLM.

They reach vLLM's periodic log line through ``KVConnectorStats`` and its
Prometheus endpoint (``/metrics``) through ``DualPathPromMetrics``. The worker's
data path records into ``stats_recorder.StatsRecorder``, which imports nothing of
vLLM (the GPU scripts run it where vLLM is not installed).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from dualpath_connector.protocol import (
    COUNTERS,
    GAUGES,
    METRIC_PREFIX,
    NAMESPACE_INFO_METRIC,
    SHARD_NAMESPACES_LABEL,
    SIZES,
    TIMINGS,
    StoreKeySpace,
)
from dualpath_connector.metrics.stats_recorder import SAMPLED, empty_stats, stats_empty

@dataclass
class DualPathStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=empty_stats)

    def reset(self) -> None:
        self.data = empty_stats()

    def aggregate(self, other: KVConnectorStats) -> DualPathStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in SAMPLED:
            self.data[name].extend(other.data.get(name, []))
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        # Local-tier counters only where a local tier runs (they stay 0 elsewhere and would only lengthen the line).
        out: dict[str, int | float] = {
            name: self.data[name] for name in COUNTERS if self.data[name] or not name.startswith("local_tier_")
        }
        for name in SAMPLED:
            values = self.data[name]
            out[f"{name}_median"] = round(statistics.median(values), 4) if values else 0.0
        out.update(self.data["gauges"])
        return out

    def is_empty(self) -> bool:
        return stats_empty(self.data)


class DualPathPromMetrics(KVConnectorPromMetrics):
    """``dualpath_kv:*`` counters and histograms on vLLM's /metrics, one label set per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(name=f"{METRIC_PREFIX}{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        seconds = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        nbytes = [float(1 << shift) for shift in range(16, 36, 2)]  # 64 KiB .. 16 GiB, x4
        self._histograms = {
            name: create_metric_per_engine(
                self._histogram_cls(name=f"{METRIC_PREFIX}{name}", documentation=doc, buckets=buckets, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for docs, buckets in ((TIMINGS, seconds), (SIZES, nbytes))
            for name, doc in docs.items()
        }
        self._gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(name=f"{METRIC_PREFIX}{name}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for name, doc in GAUGES.items()
        }
        self._export_namespace(vllm_config, labelnames, per_engine_labelvalues)

    def _export_namespace(self, vllm_config, labelnames, per_engine_labelvalues) -> None:
        """What a router needs to compute this engine's keys: one info series per engine."""
        from dualpath_connector.config import ChunkGeometry, parse_config, shard_namespaces

        kv_transfer = vllm_config.kv_transfer_config
        config = parse_config(kv_transfer.kv_connector_extra_config, kv_transfer.kv_role)
        chunk_tokens = ChunkGeometry.of(config, vllm_config).chunk_tokens
        shards = shard_namespaces(vllm_config, config, chunk_tokens)
        info = {
            **StoreKeySpace.of(shards[0], config.key_prefix).to_labels(),
            # Every rank's shard namespace, rank 0's first: readers (ShardedKeySpace) check a chunk whole.
            SHARD_NAMESPACES_LABEL: ",".join(shard.digest() for shard in shards),
            "kv_role": kv_transfer.kv_role,
        }
        gauge = self._gauge_cls(
            name=NAMESPACE_INFO_METRIC,
            documentation="The store namespace and chunk geometry of this engine's keys (value 1)",
            labelnames=[*labelnames, *info],
        )
        for values in per_engine_labelvalues.values():
            gauge.labels(*values, *info.values()).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for name, per_engine in self._histograms.items():
            for value in transfer_stats_data.get(name, []):
                per_engine[engine_idx].observe(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            self._gauges[name][engine_idx].set(value)
