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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice


@dataclass(frozen=True)
class ResidencyPlan:
    knob_bytes: int
    page_cache_layers: int  # n1 for every resident chunk
    boosted: frozenset[str] = field(default_factory=frozenset)  # chunks with n1 + 1 layers

    def layers_for(self, key: str) -> int:
        return self.page_cache_layers + (key in self.boosted)


def plan_residency(
    knob_bytes: int, layer_block_bytes: int, num_layers: int, num_chunks: int, hottest_first: Iterable[str]
) -> ResidencyPlan:
    """Algorithm 1 for ``num_chunks`` resident chunks (a new chunk counts as one more)."""
    if knob_bytes < 0 or layer_block_bytes <= 0 or num_layers <= 0:
        raise ValueError(f"bad plan inputs: X={knob_bytes}, S={layer_block_bytes}, L={num_layers}")
    chunks = max(num_chunks, 1)
    n1 = min(knob_bytes // (chunks * layer_block_bytes), num_layers)
    if n1 == num_layers:
        return ResidencyPlan(knob_bytes, n1)
    extra = (knob_bytes - n1 * chunks * layer_block_bytes) // layer_block_bytes
    hottest: Iterator[str] = iter(hottest_first)
    return ResidencyPlan(knob_bytes, n1, frozenset(islice(hottest, extra)))
