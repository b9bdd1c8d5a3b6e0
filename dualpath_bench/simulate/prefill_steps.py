"""Prefill in engine steps, a node's engines in lockstep, with or without the compute quota (§6.2, A.4).

The default simulation computes each turn's prefill whole, one at a time per engine. This model is
what §6.2 is about: with data-parallel attention the GPUs of a node meet after every attention layer
(the experts' all-to-all), so a node's step lasts as long as its slowest engine's, and an engine
with a short step idles (a bubble) while one with a long prefill finishes. Each engine's step packs
its ready turns FIFO up to ``token_budget`` new tokens; with a quota, also only while the predicted
attention + linear time stays under it, the first turn that does not fit chunked by binary search
(never below one block for the step's first turn). Times come from :meth:`SimHardware.prefill_s`,
the same model the quota predicts with (so the prediction is exact here, unlike on a real engine).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dualpath_bench.errors import BenchUsageError
from dualpath_bench.simulate.events import EventLoop
from dualpath_bench.simulate.hardware import SimHardware


@dataclass(frozen=True)
class PrefillSteps:
    token_budget: int  # new tokens per engine step (vLLM's max_num_batched_tokens)
    quota_s: float | None = None  # the compute quota; None: steps limited by the token budget only

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise BenchUsageError(f"prefill token_budget must be >= 1, got {self.token_budget}")
        if self.quota_s is not None and not self.quota_s > 0:
            raise BenchUsageError(f"compute quota must be > 0 s, got {self.quota_s}")


@dataclass(eq=False)  # removed from its queue by identity
class _Prefill:
    turn: Any
    remaining: int  # new tokens not computed yet
    context: int  # tokens already in the KV cache (hit + chunks computed)


@dataclass
class StepStats:
    step_s: list[float] = field(default_factory=list)  # every node step's duration
    busy_s: float = 0.0  # engine-seconds computing
    engine_s: float = 0.0  # engine-seconds of node steps of the engines with work in them (busy + bubbles)

    def to_json(self) -> dict:
        steps = sorted(self.step_s)

        def at(q: float) -> float:
            return steps[min(len(steps) - 1, round(q * (len(steps) - 1)))] if steps else 0.0

        return {"steps": len(steps), "step_p50_s": at(0.5), "step_p99_s": at(0.99), "step_max_s": at(1.0),
                "bubble_fraction": 1 - self.busy_s / self.engine_s if self.engine_s else 0.0}  # fmt: skip


class NodeStepper:
    """Runs the prefill steps of every PE node; ``done(turn)`` when a turn's prefill is complete."""

    def __init__(self, hw: SimHardware, settings: PrefillSteps, loop: EventLoop, engines_by_node: dict[str, list[str]],
                 done: Callable[[Any], None]) -> None:  # fmt: skip
        self.hw, self.settings, self.loop, self.done = hw, settings, loop, done
        self.engines_by_node = engines_by_node
        self.node_of = {e: node for node, engines in engines_by_node.items() for e in engines}
        self.ready: dict[str, deque[_Prefill]] = {e: deque() for e in self.node_of}
        self.stepping: set[str] = set()
        self.stats = StepStats()

    def submit(self, engine: str, turn: Any, new_tokens: int, cached_tokens: int) -> None:
        self.ready[engine].append(_Prefill(turn, new_tokens, cached_tokens))
        node = self.node_of[engine]
        if node not in self.stepping:
            self.stepping.add(node)
            self._step(node)

    def plan(self, queue: deque[_Prefill]) -> list[tuple[_Prefill, int]]:
        """One engine's step: (prefill, tokens) in FIFO order under the token budget and the quota."""
        hw, budget, quota = self.hw, self.settings.token_budget, self.settings.quota_s or math.inf
        chosen: list[tuple[_Prefill, int]] = []
        used_s = 0.0
        for prefill in queue:
            if budget == 0:
                break
            wanted = min(prefill.remaining, budget)
            tokens = bisect.bisect_right(range(wanted + 1), quota - used_s,
                                         key=lambda n: hw.prefill_s(n, prefill.context)) - 1  # fmt: skip
            if not chosen:
                tokens = max(tokens, min(wanted, hw.block_tokens))  # the floor: a prefill always progresses
            if tokens <= 0:
                break
            chosen.append((prefill, tokens))
            used_s += hw.prefill_s(tokens, prefill.context)
            budget -= tokens
            if tokens < wanted:
                break  # chunked: the quota or the budget is used up
        return chosen

    def _step(self, node: str) -> None:
        plans = {e: self.plan(self.ready[e]) for e in self.engines_by_node[node]}
        times = {e: sum(self.hw.prefill_s(n, p.context) for p, n in plan) for e, plan in plans.items()}
        step_s = max(times.values())
        if step_s == 0.0:
            self.stepping.discard(node)
            return
        self.stats.step_s.append(step_s)
        self.stats.busy_s += sum(times.values())
        # An engine with nothing to do loses nothing; one with a short step waits for the slowest.
        self.stats.engine_s += step_s * sum(1 for plan in plans.values() if plan)
        self.loop.at(self.loop.now + step_s, self._stepped, (node, plans))

    def _stepped(self, arg: tuple[str, dict[str, list[tuple[_Prefill, int]]]]) -> None:
        node, plans = arg
        for engine, plan in plans.items():
            for prefill, tokens in plan:
                prefill.remaining -= tokens
                prefill.context += tokens
                if prefill.remaining == 0:
                    self.ready[engine].remove(prefill)
                    self.done(prefill.turn)
        self._step(node)
