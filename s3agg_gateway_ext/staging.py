"""Bounded staging memory: a budget every request's staging buffer is taken from, and a reaper that gives
back what abandoned transfers staged once NIXL is done with it.

A request's staging size follows from its descriptor (:func:`staging_plan`): the gateway refuses one that
would need more than ``max_request_staging_bytes`` (400 ``InvalidArgument``, as
every descriptor limit) before anything is read, and takes its bytes from
a budget of ``max_staging_bytes`` shared by every request when its stream starts; a request that finds no
room within ``staging_wait_s`` ends with ``SlowDown`` (its client reads the chunks from the bucket).

A transfer still in flight at ``io_timeout_s`` may write its staging buffer (a storage READ) or read it
(a WRITE to the client) at any later time, so that buffer can be neither reused nor freed then. It is not
kept forever either: the aggregator's :class:`~nixl_backends.abandoned.AbandonedTransfers` holds it, with the
transfers' NIXL handles, and frees the buffer and returns its bytes to the budget once every one of them has
ended. A transfer that never ends keeps its bytes out of the budget: the gateway then refuses work instead of
growing.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from s3agg_gateway_ext.descriptor import Descriptor, DescriptorError


class StagingBusy(TimeoutError):
    """No room in the staging budget within ``staging_wait_s`` (SlowDown: the client falls back to the bucket)."""


@dataclass(frozen=True)
class StagingPlan:
    """How a request is staged: ``window_layers`` consecutive layers per read, ``nbytes`` of staging."""

    window_layers: int
    nbytes: int
    # True when one window covers every layer: each object is one GET, staged whole.
    whole_objects: bool


def staging_plan(desc: Descriptor, layerwise: bool, min_read_bytes: int, max_request_bytes: int) -> StagingPlan:
    """The staging a request needs: whole objects (chunkwise, or layerwise with a window of every layer), else
    two alternating windows of ``k`` layers and every chunk's trailer.

    ``k`` is the fewest layers of at least ``min_read_bytes``, lowered until the staging fits in
    ``max_request_bytes``; a request that does not fit even with one layer per window is refused.
    """
    n, num_layers, s, d = desc.num_chunks, desc.num_layers, desc.layer_bytes, desc.digest_bytes
    whole = n * desc.object_bytes
    if not layerwise:
        return _fitting(StagingPlan(num_layers, whole, True), max_request_bytes)
    k = min(num_layers, max(1, math.ceil(min_read_bytes / s)))
    if k == num_layers and whole <= max_request_bytes:
        return StagingPlan(num_layers, whole, True)
    trailers = n * num_layers * d
    # Two windows alternate (w+1 read while w is delivered); one window of every layer would be the whole object.
    k = min(k, num_layers - 1, (max_request_bytes - trailers) // (2 * n * (s + d)))
    if k < 1:
        return _fitting(StagingPlan(1, trailers + min(2, num_layers) * n * (s + d), False), max_request_bytes)
    return StagingPlan(k, trailers + 2 * n * k * (s + d), False)


def _fitting(plan: StagingPlan, max_request_bytes: int) -> StagingPlan:
    if plan.nbytes > max_request_bytes:
        raise DescriptorError(
            400, "InvalidArgument",
            f"the request needs {plan.nbytes} bytes of staging, above this gateway's "
            f"max_request_staging_bytes={max_request_bytes}")
    return plan


class StagingBudget:
    """Bytes of staging memory in use by every request together, at most ``total_bytes``."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self._in_use = 0
        self._changed = threading.Condition()

    @property
    def in_use(self) -> int:
        with self._changed:
            return self._in_use

    def take(self, nbytes: int, timeout_s: float) -> None:
        """Take ``nbytes`` once they fit (first come is not guaranteed first served); :class:`StagingBusy` if
        they do not within ``timeout_s``."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._in_use + nbytes <= self.total_bytes, timeout_s):
                raise StagingBusy(
                    f"{nbytes} bytes of staging not free within {timeout_s:.1f}s "
                    f"({self._in_use} of max_staging_bytes={self.total_bytes} in use)")
            self._in_use += nbytes

    def give_back(self, nbytes: int) -> None:
        with self._changed:
            self._in_use -= nbytes
            self._changed.notify_all()
