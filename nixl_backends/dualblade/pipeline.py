"""The adaptive read pipeline (the paper's §IV-C): try both overlap strategies, keep the faster.

A multi-chunk read has work on two hardware paths: direct reads, which the
device moves by DMA while the CPU waits, and page-cache reads, which the CPU
copies out of the page cache (or, on a miss, waits for). The order in which
they are submitted decides what overlaps:

- ``intra``: chunk by chunk, each chunk's page-cache and direct parts
  together; reads of the same kind overlap each other, the device idles
  while the CPU copies a chunk's page-cache part.
- ``cross``: every direct read first, then the page-cache copies, so the
  device works through its queue while the CPU copies: overlap across paths
  (the paper's staggered start).

Which wins depends on the device, the page cache and how many cores are
free, so, as in the paper, the first read is a warm-up, the next
``2 * trial_rounds`` alternate the two, and the one with the higher median
throughput is kept until the residency plan changes (then it is tried again).
"""

from __future__ import annotations

import logging
import statistics
from typing import Literal

logger = logging.getLogger(__name__)

STRATEGIES = ("intra", "cross")
Strategy = Literal["intra", "cross"]


class AdaptivePipeline:
    def __init__(self, mode: Literal["adaptive", "intra", "cross"] = "adaptive", trial_rounds: int = 2) -> None:
        if mode not in ("adaptive", *STRATEGIES) or trial_rounds < 1:
            raise ValueError(f"bad pipeline mode {mode!r} or trial_rounds {trial_rounds}")
        self.mode = mode
        self.trial_rounds = trial_rounds
        self.chosen: Strategy | None = None if mode == "adaptive" else mode
        self._reads = 0
        self._rates: dict[str, list[float]] = {s: [] for s in STRATEGIES}

    def next_strategy(self) -> Strategy:
        if self.chosen is not None:
            return self.chosen
        # Read 0 warms up (cold page cache); then intra, cross, intra, cross, ...
        return STRATEGIES[max(self._reads - 1, 0) % 2]

    def record(self, strategy: Strategy, nbytes: int, seconds: float) -> None:
        if self.chosen is not None:
            return
        self._reads += 1
        if self._reads == 1:
            return  # the warm-up read is not measured
        self._rates[strategy].append(nbytes / max(seconds, 1e-9))
        if all(len(rates) >= self.trial_rounds for rates in self._rates.values()):
            medians = {s: statistics.median(r) for s, r in self._rates.items()}
            self.chosen = max(STRATEGIES, key=medians.__getitem__)
            logger.info("dualblade: read pipeline %s (median %s)", self.chosen,
                        ", ".join(f"{s} {m / 1e6:.0f} MB/s" for s, m in medians.items()))

    def retry(self) -> None:
        """Try both again (the share of each path changed)."""
        if self.mode == "adaptive":
            self.chosen = None
            self._reads = 0
            self._rates = {s: [] for s in STRATEGIES}
