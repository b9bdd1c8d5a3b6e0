"""What the router knows about engine and node load (paper §6.1: tok_e, seq_e, read_q_n(e)).

The router counts what it dispatched itself: exact for its own requests, and
updated the moment it dispatches, which the engines' metrics cannot be. The
engines' ``/metrics`` add what the router cannot see (other clients, reads a
DE serves for other PEs, KV memory). Where both count the same thing the
larger wins: the router's own requests are never counted twice, and load
the router did not send is never missed.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from nixl_backends.rates import RateEstimate

from dualpath_connector.protocol import METRIC_PREFIX, NAMESPACE_INFO_METRIC, ProtocolError, StoreKeySpace, metric_samples

from dualpath_router.config import EngineConfig

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]

READ_QUEUE_METRIC = f"{METRIC_PREFIX}read_queue_tokens"
# vLLM's own measure of prefill compute: tokens computed (hits excluded) and
# the time from scheduling to the first token (a hit's read ends before that).
COMPUTED_TOKENS_METRIC = "vllm:request_prefill_kv_computed_tokens_sum"
PREFILL_SECONDS_METRIC = "vllm:request_prefill_time_seconds_sum"


@dataclass
class EngineLoad:
    """One engine's load as the router sees it."""

    config: EngineConfig
    role: Role
    # Tokens and requests the router dispatched and not yet seen finish. A
    # PE's tokens are those it must compute (prompt minus hit): its reads are
    # counted in the read queues, and beta bounds compute, as in the paper.
    dispatched_tokens: int = 0
    dispatched_requests: int = 0
    # From the engine's /metrics (None until a scrape succeeded).
    reported_requests: int | None = None
    reported_read_queue_tokens: int = 0
    kv_usage: float | None = None
    kv_capacity_tokens: int | None = None
    # Cumulative counters of the last scrape, to take deltas of.
    reported_computed_tokens: float | None = None
    reported_prefill_seconds: float | None = None
    # False after a failed scrape or dispatch, until the next good scrape.
    healthy: bool = True

    def __setattr__(self, name: str, value: object) -> None:
        # Every change to a booked field, from the router or written directly
        # (tests, the simulator), also moves its Accounting's node totals, so
        # the totals can never drift from the per-engine values.
        books = self.__dict__.get("_books")
        if books is None or name not in _BOOKED_FIELDS:
            object.__setattr__(self, name, value)
            return
        before = (self.dispatched_tokens, self.read_queue_share, self.healthy)
        object.__setattr__(self, name, value)
        books.changed(self, *before)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def node(self) -> str:
        return self.config.node

    @property
    def unfinished_tokens(self) -> int:
        # vLLM exports request counts, not token counts: tokens are ours alone.
        return self.dispatched_tokens

    @property
    def read_queue_share(self) -> int:
        # vLLM ships connector stats with step outputs, so an engine without
        # requests (a DE reading for a PE before its decode arrives) keeps
        # showing the queue of its last step: only stepping engines count.
        return self.reported_read_queue_tokens if self.reported_requests else 0

    @property
    def unfinished_requests(self) -> int:
        return max(self.dispatched_requests, self.reported_requests or 0)

    @property
    def free_kv_tokens(self) -> float | None:
        if self.kv_usage is None or self.kv_capacity_tokens is None:
            return None
        return (1.0 - self.kv_usage) * self.kv_capacity_tokens


_BOOKED_FIELDS = frozenset({"dispatched_tokens", "reported_requests", "reported_read_queue_tokens", "healthy"})


class NodeBooks:
    """Per-node totals of the engines' loads, kept as the engines change, so a placement costs O(nodes).

    ``tokens[(role, node)]``: unfinished tokens of the node's engines of that
    role (a DE group's load); ``reported_read[node]``: the stepping engines'
    reported read queues; ``unhealthy[role]``: engines marked unhealthy.
    """

    def __init__(self, engines: Iterable[EngineLoad]) -> None:
        self.by_role: dict[Role, list[EngineLoad]] = {"prefill": [], "decode": []}
        # Nodes per role in the order of their first engine: the order a grouping of the role list gives.
        self.nodes_by_role: dict[Role, list[str]] = {"prefill": [], "decode": []}
        self.members: dict[tuple[Role, str], list[EngineLoad]] = {}
        self.position: dict[str, int] = {}
        self.tokens: dict[tuple[Role, str], int] = {}
        self.reported_read: dict[str, int] = {}
        self.unhealthy: dict[Role, int] = {"prefill": 0, "decode": 0}
        # The engine with the fewest tokens (first in role order on a tie) per node, recomputed when stale.
        self._least: dict[tuple[Role, str], EngineLoad] = {}
        self._stale: set[tuple[Role, str]] = set()
        for engine in engines:
            key = (engine.role, engine.node)
            self.position[engine.name] = len(self.by_role[engine.role])
            self.by_role[engine.role].append(engine)
            if key not in self.members:
                self.members[key] = []
                self.nodes_by_role[engine.role].append(engine.node)
                self.tokens[key] = 0
                self._stale.add(key)
            self.members[key].append(engine)
            self.tokens[key] += engine.dispatched_tokens
            self.reported_read[engine.node] = self.reported_read.get(engine.node, 0) + engine.read_queue_share
            self.unhealthy[engine.role] += not engine.healthy
            object.__setattr__(engine, "_books", self)

    def changed(self, engine: EngineLoad, tokens: int, read_share: int, healthy: bool) -> None:
        """``engine`` changed; the arguments are its values before."""
        if engine.dispatched_tokens != tokens:
            key = (engine.role, engine.node)
            self.tokens[key] += engine.dispatched_tokens - tokens
            self._stale.add(key)
        self.reported_read[engine.node] += engine.read_queue_share - read_share
        self.unhealthy[engine.role] += healthy - engine.healthy

    def least_tokens(self, role: Role, node: str) -> EngineLoad:
        key = (role, node)
        if key in self._stale:
            self._least[key] = min(self.members[key], key=lambda e: (e.unfinished_tokens, self.position[e.name]))
            self._stale.discard(key)
        return self._least[key]


@dataclass
class EngineReport:
    """What one /metrics scrape says."""

    requests: int
    read_queue_tokens: int
    kv_usage: float | None
    kv_capacity_tokens: int | None
    namespace: StoreKeySpace | None
    computed_tokens: float | None = None
    prefill_seconds: float | None = None


def parse_engine_metrics(text: str) -> EngineReport:
    """Sum each series over its label sets (engines export one per engine index/model)."""
    totals: dict[str, float] = defaultdict(float)
    capacity: int | None = None
    namespace: StoreKeySpace | None = None
    for name, labels, value in metric_samples(text):
        totals[name] += value
        if name == "vllm:cache_config_info":
            blocks, block_size = labels.get("num_gpu_blocks"), labels.get("block_size")
            if blocks and block_size and blocks.isdigit() and block_size.isdigit():
                capacity = (capacity or 0) + int(blocks) * int(block_size)
        elif name == NAMESPACE_INFO_METRIC and namespace is None:
            namespace = _key_space_from_labels(labels)
    usage = totals.get("vllm:kv_cache_usage_perc")
    return EngineReport(
        requests=int(totals.get("vllm:num_requests_running", 0) + totals.get("vllm:num_requests_waiting", 0)),
        read_queue_tokens=int(totals.get(READ_QUEUE_METRIC, 0)),
        kv_usage=None if usage is None else min(max(usage, 0.0), 1.0),
        kv_capacity_tokens=capacity,
        namespace=namespace,
        computed_tokens=totals.get(COMPUTED_TOKENS_METRIC),
        prefill_seconds=totals.get(PREFILL_SECONDS_METRIC),
    )


def _key_space_from_labels(labels: dict[str, str]) -> StoreKeySpace | None:
    try:
        return StoreKeySpace.from_labels(labels)
    except ProtocolError as exc:
        # One engine's bad labels must not stop the scrape: its load still counts.
        logger.warning("ignoring malformed %s labels %s: %s", NAMESPACE_INFO_METRIC, labels, exc)
        return None


class ReadQueues(Mapping[str, int]):
    """A read-only view of :meth:`Accounting.read_queue_tokens` over the nodes that have engines."""

    def __init__(self, accounting: Accounting) -> None:
        self._accounting = accounting

    def __getitem__(self, node: str) -> int:
        if node not in self._accounting.books.reported_read:
            raise KeyError(node)
        return self._accounting.read_queue_tokens(node)

    def get(self, node: str, default: int | None = None) -> int | None:  # type: ignore[override]
        # Mapping.get goes through __getitem__ and KeyError: this runs per node on every placement.
        reported = self._accounting.books.reported_read.get(node)
        return default if reported is None else max(self._accounting.dispatched_read_tokens[node], reported)

    def __iter__(self) -> Iterator[str]:
        return iter(self._accounting.books.reported_read)

    def __len__(self) -> int:
        return len(self._accounting.books.reported_read)


class ThroughputEstimate(RateEstimate):
    """A rate learnt from completed work and the busy time it took.

    Each resource (a node's read path) is busy while it has work
    outstanding. A completion of ``t`` tokens is charged the busy time since
    the resource's previous completion (or since it became busy), so
    concurrent work is not charged twice.
    """

    def __init__(self, initial_tokens_per_s: float, weight: float, clock: Callable[[], float] | None = None) -> None:
        super().__init__(initial_tokens_per_s, weight)
        # Wall time for the router; simulated time for dualpath_bench.simulate.
        self._clock = clock or time.monotonic
        self._outstanding: dict[str, int] = defaultdict(int)
        self._busy_mark: dict[str, float] = {}

    def started(self, resource: str) -> None:
        if self._outstanding[resource] == 0:
            self._busy_mark[resource] = self._clock()
        self._outstanding[resource] += 1

    def finished(self, resource: str, tokens: int, *, completed: bool) -> None:
        """``completed=False`` (failure): the busy time is dropped, not charged as throughput."""
        now = self._clock()
        busy_s = now - self._busy_mark.get(resource, now)
        self._busy_mark[resource] = now
        self._outstanding[resource] = max(self._outstanding[resource] - 1, 0)
        if completed:
            self.add(tokens, busy_s)


@dataclass
class Accounting:
    """Per-engine unfinished tokens/requests and per-node read-queue tokens."""

    engines: dict[str, EngineLoad]
    # Per PE, learnt from the PEs' own compute measurements (scrapes): a rate
    # learnt from end-to-end answers would include store reads, and in the
    # storage-bound regime beta would shrink to a single request.
    prefill_rate: RateEstimate
    read_rate: ThroughputEstimate
    # Tokens the router sent to be read on each node and not yet answered.
    dispatched_read_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    books: NodeBooks = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # The set of engines is fixed for the Accounting's life.
        self.books = NodeBooks(self.engines.values())

    @classmethod
    def build(
        cls,
        prefill: Iterable[EngineConfig],
        decode: Iterable[EngineConfig],
        prefill_tokens_per_s: float,
        read_tokens_per_s: float,
        rate_weight: float,
    ) -> Accounting:
        engines = {e.name: EngineLoad(e, "prefill") for e in prefill}
        engines.update({e.name: EngineLoad(e, "decode") for e in decode})
        return cls(
            engines,
            RateEstimate(prefill_tokens_per_s, rate_weight),
            ThroughputEstimate(read_tokens_per_s, rate_weight),
        )

    def role(self, role: Role) -> list[EngineLoad]:
        """The engines of ``role`` in configuration order; the same list each call: read it, never change it."""
        return self.books.by_role[role]

    def all_healthy(self, role: Role) -> bool:
        return self.books.unhealthy[role] == 0

    def nodes(self) -> set[str]:
        return set(self.books.reported_read)

    def read_queue_tokens(self, node: str) -> int:
        """O(1): the larger of what the router sent to be read on ``node`` and what its stepping engines report."""
        return max(self.dispatched_read_tokens[node], self.books.reported_read.get(node, 0))

    def read_queues(self) -> ReadQueues:
        """Every node's :meth:`read_queue_tokens`, each computed when looked up."""
        return ReadQueues(self)

    def alpha_tokens(self, alpha_s: float) -> float:
        return alpha_s * self.read_rate.tokens_per_s

    def beta_tokens(self, beta_s: float) -> float:
        return beta_s * self.prefill_rate.tokens_per_s

    # Dispatch and completion; every add has exactly one matching remove.
    def prefill_started(self, pe: EngineLoad, tokens: int, read_node: str, hit_tokens: int) -> None:
        pe.dispatched_tokens += tokens - hit_tokens
        pe.dispatched_requests += 1
        self.dispatched_read_tokens[read_node] += hit_tokens
        if hit_tokens:
            self.read_rate.started(read_node)

    def prefill_finished(
        self, pe: EngineLoad, tokens: int, read_node: str, hit_tokens: int, *, completed: bool
    ) -> None:
        pe.dispatched_tokens -= tokens - hit_tokens
        pe.dispatched_requests -= 1
        self.dispatched_read_tokens[read_node] -= hit_tokens
        if hit_tokens:
            # The PE answers after reading and computing: an upper bound on the read time.
            self.read_rate.finished(read_node, hit_tokens, completed=completed)

    def decode_started(self, de: EngineLoad, tokens: int) -> None:
        de.dispatched_tokens += tokens
        de.dispatched_requests += 1

    def decode_finished(self, de: EngineLoad, tokens: int) -> None:
        de.dispatched_tokens -= tokens
        de.dispatched_requests -= 1

    def apply_report(self, engine: EngineLoad, report: EngineReport | None) -> None:
        """A scrape's result; ``None`` = the scrape failed."""
        if report is None:
            engine.healthy = False
            return
        engine.healthy = True
        engine.reported_requests = report.requests
        engine.reported_read_queue_tokens = report.read_queue_tokens
        engine.kv_usage = report.kv_usage
        engine.kv_capacity_tokens = report.kv_capacity_tokens
        if engine.role == "prefill":
            self._learn_prefill_rate(engine, report)

    def _learn_prefill_rate(self, pe: EngineLoad, report: EngineReport) -> None:
        if report.computed_tokens is None or report.prefill_seconds is None:
            return
        if pe.reported_computed_tokens is not None and pe.reported_prefill_seconds is not None:
            # A counter that went down is an engine restart: only re-baseline.
            self.prefill_rate.add(report.computed_tokens - pe.reported_computed_tokens,
                                  report.prefill_seconds - pe.reported_prefill_seconds)
        pe.reported_computed_tokens = report.computed_tokens
        pe.reported_prefill_seconds = report.prefill_seconds

