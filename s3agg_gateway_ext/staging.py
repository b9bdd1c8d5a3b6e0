"""Bounded staging memory: a budget every request's staging buffer is taken from, and a reaper that gives
back what abandoned transfers staged once NIXL is done with it.

A request's staging size follows from its descriptor (:func:`staging_plan`): the gateway refuses one that
would need more than ``max_request_staging_bytes`` (400 ``InvalidArgument``, as
every descriptor limit) before anything is read, and takes its bytes from
a budget of ``max_staging_bytes`` shared by every request when its stream starts; a request that finds no
room within ``staging_wait_s`` ends with ``SlowDown`` (its client reads the chunks from the bucket).

A transfer still in flight at ``io_timeout_s`` may write its staging buffer (a storage READ) or read it
(a WRITE to the client) at any later time, so that buffer can be neither reused nor freed then. It is not
kept forever either: :class:`StagingReaper` holds it, with the transfers' NIXL handles, polls those handles,
and frees the buffer and returns its bytes to the budget once every one of them has ended. A transfer that
never ends keeps its bytes out of the budget: the gateway then refuses work instead of growing.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from s3agg_gateway_ext.descriptor import Descriptor, DescriptorError

logger = logging.getLogger(__name__)


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


@dataclass
class _Abandoned:
    agent: Any
    handles: list[Any]
    # The buffer itself: referenced here so that it outlives every transfer into or out of it.
    memory: Any
    free: Callable[[], None]
    nbytes: int
    request_id: str


class StagingReaper:
    """Frees abandoned staging once every NIXL transfer that may touch it has ended (a thread of its own)."""

    def __init__(self, budget: StagingBudget, poll_s: float = 0.1) -> None:
        self._budget = budget
        self._poll_s = poll_s
        self._held: list[_Abandoned] = []
        self._changed = threading.Condition()
        # One reap at a time: two would both see an entry's transfers ended and free it twice.
        self._reaping = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="s3agg-staging-reaper", daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        with self._changed:
            return sum(entry.nbytes for entry in self._held)

    def hold(self, agent: Any, handles: Sequence[Any], memory: Any, free: Callable[[], None], nbytes: int,
             request_id: str) -> None:
        """Keep ``memory``, a staging buffer of ``nbytes`` (taken from the budget), until ``handles`` have ended,
        then call ``free`` (deregister it, release what it read from), drop it and give the bytes back."""
        with self._changed:
            self._held.append(_Abandoned(agent, list(handles), memory, free, nbytes, request_id))
            self._changed.notify_all()

    def reap(self) -> int:
        """Free every held buffer whose transfers all ended; how many were freed."""
        with self._reaping:
            return self._reap()

    def _reap(self) -> int:
        with self._changed:
            held = list(self._held)
        done = [entry for entry in held if self._ended(entry)]
        for entry in done:
            try:
                entry.free()
            except Exception:  # a deregistration failing must not keep the bytes out of the budget forever
                logger.exception("request %s: freeing abandoned staging failed", entry.request_id)
            entry.memory = None
            self._budget.give_back(entry.nbytes)
            logger.warning("request %s: abandoned transfers ended; %d bytes of staging freed", entry.request_id,
                           entry.nbytes)
        with self._changed:
            self._held = [entry for entry in self._held if entry not in done]
        return len(done)

    @staticmethod
    def _ended(entry: _Abandoned) -> bool:
        """True once no handle is in flight; the ended ones are released as they are seen."""
        still: list[Any] = []
        for handle in entry.handles:
            try:
                state = entry.agent.check_xfer_state(handle)
            except Exception:  # NIXL reports a failed transfer by raising: it ended
                state = "ERR"
            if state == "PROC":
                still.append(handle)
            else:
                entry.agent.release_xfer_handle(handle)
        entry.handles = still
        return not still

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or self._held)
                if self._closed:
                    return
            self.reap()
            with self._changed:
                self._changed.wait_for(lambda: self._closed, self._poll_s)

    def close(self) -> None:
        """Stop polling; what is still held stays allocated (NIXL may still touch it) until the process ends."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
