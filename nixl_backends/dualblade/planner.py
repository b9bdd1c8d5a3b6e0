"""Residency planning (the paper's Algorithm 1, with its pluggable ranker): which layers take the page cache.

Every chunk is a stack of Layer Blocks (the paper's KPU pairs: one layer's K
and V). The knob ``X`` (bytes, at most the page-cache budget) admits the
first ``n1`` layers of every resident chunk to the page-cache path and sends
the rest down the direct path: ``n1 = min(X // (N * S), L)`` for ``N``
resident chunks of ``S`` bytes per layer. What ``X`` has left over after
that (less than one more layer for every chunk) goes to the hottest chunks
the ranker names, one more layer each, so no byte of the budget idles.

Layer order matters: layer 0 is what a layerwise load needs first, so the
page-cache share is the front of every chunk.

``plan_ranked`` is the ranker-driven variant the paper leaves open ("a ranker
can drive X such that only top-ranked tensors occupy the page-cache path"):
the hottest ``X // (L * S)`` chunks take the page cache whole and every other
chunk goes direct. Under a skewed reuse (agents re-reading their own recent
prefixes) the hot set is then served from memory entirely, while the uniform
split reads a direct share of every chunk, hot or cold.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice


@dataclass(frozen=True)
class ResidencyPlan:
    knob_bytes: int
    page_cache_layers: int  # n1 for every resident chunk
    boosted: frozenset[str] = field(default_factory=frozenset)  # chunks with boosted_layers instead
    boosted_layers: int = 0

    def layers_for(self, key: str) -> int:
        return self.boosted_layers if key in self.boosted else self.page_cache_layers


def plan_residency(
    knob_bytes: int, layer_block_bytes: int, num_layers: int, num_chunks: int, hottest_first: Iterable[str]
) -> ResidencyPlan:
    """Algorithm 1 for ``num_chunks`` chunks (the store passes its extent count: the most it can hold)."""
    _check(knob_bytes, layer_block_bytes, num_layers)
    chunks = max(num_chunks, 1)
    n1 = min(knob_bytes // (chunks * layer_block_bytes), num_layers)
    if n1 == num_layers:
        return ResidencyPlan(knob_bytes, n1)
    extra = (knob_bytes - n1 * chunks * layer_block_bytes) // layer_block_bytes
    hottest: Iterator[str] = iter(hottest_first)
    return ResidencyPlan(knob_bytes, n1, frozenset(islice(hottest, extra)), n1 + 1)


def plan_ranked(knob_bytes: int, layer_block_bytes: int, num_layers: int, hottest_first: Iterable[str]) -> ResidencyPlan:
    """Whole chunks, hottest first, as many as ``X`` holds; the rest direct."""
    _check(knob_bytes, layer_block_bytes, num_layers)
    whole = knob_bytes // (num_layers * layer_block_bytes)
    return ResidencyPlan(knob_bytes, 0, frozenset(islice(iter(hottest_first), whole)), num_layers)


def _check(knob_bytes: int, layer_block_bytes: int, num_layers: int) -> None:
    if knob_bytes < 0 or layer_block_bytes <= 0 or num_layers <= 0:
        raise ValueError(f"bad plan inputs: X={knob_bytes}, S={layer_block_bytes}, L={num_layers}")
