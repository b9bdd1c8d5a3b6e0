"""One PE-side hit read over both storage links: the head here, the tail by the request's DE.

A long hit read by one engine keeps the other node's storage link idle for as
long as the read lasts (the paper's §4 names splitting a hit across both
sides as future work). Splitting it at the point where both sides would finish
together, given what this engine has queued, halves that read on idle links.

The hit must stay a prefix (vLLM loads a contiguous run of blocks): a tail is
used only if the whole head was read, and a head part that came back short
releases the tail. Released with the request's keep token, the DE keeps the
tail for its own decode either way, and uses it only where the chunk hashes
it computes from the prompt match.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

# Imported for hints only: the simulator plans reads with this module and must not import vLLM.
if TYPE_CHECKING:
    from dualpath_connector.metadata import LoadSpec
    from dualpath_connector.load.loaded_hit import LoadedHit


# The connector's defaults for the settings that shape a plan (config.py's), here so that the simulator,
# which may import this module but not the config, plans with them too.
# A part this long is worth its own request (32 MiB of Llama-3-8B's KV, 128 KiB per token); a typical agent turn's
# hit (2k tokens in the emulation) is then halved. Not measured against the side channel's round trip.
SPLIT_READ_MIN_TOKENS = 256
DE_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReadPlan:
    """Where a hit is read: ``head_chunks`` here, the rest through the request's DE within ``deadline_s``.

    ``routed``: the router named the DE as the read side; otherwise a DE part
    is this engine's own choice (work stealing), counted as a move.
    """

    head_chunks: int
    deadline_s: float | None = None
    routed: bool = False

    @property
    def kind(self) -> str:
        """``here`` (all of it), ``through_de`` (all of it, routed or moved) or ``split`` (head here, tail by the DE)."""
        if self.deadline_s is None:
            return "here"
        return "through_de" if self.head_chunks == 0 else "split"


def routed_to_de(deadline_s: float) -> ReadPlan:
    """The router chose the DE's read path for the whole hit; it has ``deadline_s`` before this engine reads it."""
    return ReadPlan(0, deadline_s, routed=True)


def plan_read(
    *,
    num_chunks: int,
    chunk_tokens: int,
    hit_tokens: int,
    queued_tokens: int,
    tokens_per_s: float | None,
    max_deadline_s: float,
    split_min_tokens: int,
    min_deadline_s: float = 0.0,
) -> ReadPlan:
    """Split point of one PE-side read of ``hit_tokens``, given ``queued_tokens`` ahead on this link.

    The whole read would end here in ``(queued + hit) / rate``; that is the
    deadline the DE gets for what it is offered (it declines what it cannot
    read sooner). With an idle DE at this link's rate both sides end together
    when this engine keeps ``(hit - queued) / 2`` tokens: so a read on an idle
    link is halved, and one behind at least its own length moves whole.
    Parts under ``split_min_tokens`` are not worth a second request; 0 never
    splits. Without a measured rate nothing is offered. ``min_deadline_s``
    (at most ``max_deadline_s``) is the least deadline offered.
    """
    if tokens_per_s is None or num_chunks == 0:
        return ReadPlan(num_chunks)
    deadline_s = min(max((queued_tokens + hit_tokens) / tokens_per_s, min_deadline_s), max_deadline_s)
    if split_min_tokens > 0:
        head = round(max(hit_tokens - queued_tokens, 0) / 2 / chunk_tokens)
        smallest = max(1, -(-split_min_tokens // chunk_tokens))
        if smallest <= head <= num_chunks - smallest:
            return ReadPlan(head, deadline_s)
    if queued_tokens > 0:
        return ReadPlan(0, deadline_s)  # behind other reads: the whole read is offered
    return ReadPlan(num_chunks)  # an idle link and a short hit: read here


def split_spec(spec: LoadSpec, head_chunks: int) -> tuple[LoadSpec, LoadSpec]:
    """``spec`` as its head (read here) and its tail (offered to the DE, which keeps it under the same token)."""
    return dataclasses.replace(spec, chunks=spec.chunks[:head_chunks]), dataclasses.replace(
        spec, chunks=spec.chunks[head_chunks:]
    )


class PartsJoin:
    """Waits for a split read's head and tail (on any threads) and reports the parts that form a prefix."""

    def __init__(
        self,
        head_chunks: int,
        on_parts: Callable[[list[LoadedHit]], None],
        release: Callable[[list[LoadedHit]], None],
    ) -> None:
        self._head_chunks = head_chunks
        self._on_parts = on_parts
        self._release = release
        self._lock = threading.Lock()
        self._head: LoadedHit | None = None
        self._tail: LoadedHit | None = None

    # Each part sets itself and looks for the other under one lock: only the later one joins.
    def head(self, hit: LoadedHit) -> None:
        with self._lock:
            self._head, tail = hit, self._tail
        if tail is not None:
            self._join(hit, tail)

    def tail(self, hit: LoadedHit) -> None:
        with self._lock:
            self._tail, head = hit, self._head
        if head is not None:
            self._join(head, hit)

    def _join(self, head: LoadedHit, tail: LoadedHit) -> None:
        if len(head.chunks) == self._head_chunks and tail.chunks:
            self._on_parts([head, tail])
            return
        self._release([tail])  # the hit ends inside the head (or the tail is empty)
        self._on_parts([head])
