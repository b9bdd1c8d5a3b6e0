"""Rankers: which resident chunks are hottest (kept on the page-cache path longest, evicted last).

The paper treats every tensor alike but leaves the ranking pluggable (§IV-A:
"a ranker can drive X such that only top-ranked tensors occupy the page-cache
path"). A ranker sees every bind, hit and unbind of the tier and answers two
questions: the order from hottest to coldest, and the coldest chunk that may
be evicted. Recency (LRU) is the default: an agent's next turn re-reads the
prefix its last turn used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator
from typing import Protocol


class Ranker(Protocol):
    def touch(self, key: str) -> None:
        """``key`` was bound or read: it gains rank."""

    def remove(self, key: str) -> None:
        """``key`` left the tier (absent keys are fine)."""

    def hottest_first(self) -> Iterator[str]:
        """Every ranked key, hottest first."""

    def coldest(self, skip: Container[str]) -> str | None:
        """The coldest key not in ``skip``, or None when every key is skipped."""


class RecencyRanker:
    """Least recently used is coldest."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # coldest first

    def touch(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def hottest_first(self) -> Iterator[str]:
        return reversed(self._order)

    def coldest(self, skip: Container[str]) -> str | None:
        # Skipped keys (pinned by reads in flight, or part of the write that needs room) are few.
        return next((key for key in self._order if key not in skip), None)


# Config name -> class; a new ranker is one class and one entry here.
RANKERS: dict[str, type[Ranker]] = {"recency": RecencyRanker}
