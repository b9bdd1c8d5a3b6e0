"""How long this engine would take to recompute a hit instead of loading it, from its own forwards.

A load's retries must not outlast the recompute they are meant to save (:mod:`nixl_backends.deadlines`). The
worker times each forward (``start_load_kv`` to ``wait_for_save``) with the tokens the scheduler gave it and
learns a prefill rate from the steps that compute at least ``min_step_tokens``: decode-only steps cost per
token far more than a prefill does and say nothing about recomputing a prompt. The estimate for ``n`` tokens is
``n`` over that rate, a lower bound (attention over a longer context costs more per token), so a deadline made
from it errs towards recomputing sooner, never towards a forward stalled on retries. None until a step taught it.
"""

from __future__ import annotations

import time

from nixl_backends.rates import RateEstimate

MIN_STEP_TOKENS = 256
WEIGHT = 0.2  # the newest step's weight: a few steps move the estimate, one outlier does not


class RecomputeTime:
    def __init__(self, min_step_tokens: int = MIN_STEP_TOKENS, weight: float = WEIGHT) -> None:
        self.min_step_tokens = min_step_tokens
        self._rate = RateEstimate(None, weight)
        self._step: tuple[float, int] | None = None  # (time.perf_counter() at its start, tokens it computes)

    def step_started(self, computed_tokens: int) -> None:
        self._step = (time.perf_counter(), computed_tokens)

    def step_ended(self) -> None:
        step, self._step = self._step, None
        if step is not None and step[1] >= self.min_step_tokens:
            self._rate.add(step[1], time.perf_counter() - step[0])

    def seconds(self, tokens: int) -> float | None:
        """The estimated time to compute ``tokens`` prompt tokens here; None before the first prefill step."""
        rate = self._rate.tokens_per_s
        return None if rate is None else tokens / rate
