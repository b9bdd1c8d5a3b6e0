"""NIXL transfer plumbing shared by every backend, the engine-to-engine transport and the gateway.

Transfers are described by Nx3 ``(addr_or_offset, length, dev_id)`` uint64
arrays (:func:`descriptors`), the form NIXL converts without a Python loop;
:func:`coalesce` merges neighbouring rows, :func:`run_nixl_transfers` posts
and waits, :func:`wait_until` / :class:`Polling` pace every wait on NIXL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nixl_backends.window import InFlightWindow

logger = logging.getLogger(__name__)

# Polling waits on NIXL start at _MIN_SLEEP_S and double up to _MAX_SLEEP_S:
# little latency while transfers complete, little CPU while they do not.
_MIN_SLEEP_S, _MAX_SLEEP_S = 50e-6, 1e-3


class TransferAbandoned(RuntimeError):
    """Transfers still in flight at their deadline.

    NIXL may still write their memory, so the caller must neither reuse nor
    deregister it; the store leaves its own registrations in place too.
    ``handles`` are the NIXL handles of ``agent`` still in flight (not
    released). Each layer the exception passes through names what it could
    not free with :meth:`when_ended` (a store its registrations, a reader its
    buffer), and whoever catches it last hands it to
    :class:`nixl_backends.abandoned.AbandonedTransfers`, which runs them all
    once every handle ended. Without handles (the transfers are another
    process's), a ``probe`` asks whoever runs them whether none can land any
    more (true once that is confirmed); without either, nothing is ever freed.
    """

    handles: Sequence[Any] = ()
    agent: Any = None
    probe: Callable[[], bool] | None = None

    def __init__(self, op: str, pending: int, timeout_s: float, handles: Sequence[Any] = (), agent: Any = None) -> None:
        super().__init__(f"NIXL {op}: {pending} transfers still in flight after {timeout_s:.1f}s")
        self.handles = list(handles)
        self.agent = agent

    @property
    def cleanups(self) -> list[Callable[[], None]]:
        """What to run once the handles ended, innermost (the first to add itself) first."""
        return self.__dict__.setdefault("_cleanups", [])

    def when_ended(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` once every transfer ended (never, if that cannot be known)."""
        self.cleanups.append(cleanup)


def descriptors(addrs: Any, lengths: Any, dev_ids: Any = 0) -> np.ndarray:
    """Nx3 uint64 descriptor rows ``(addr, length, dev_id)``; the columns broadcast against each other.

    Array columns of any shape are flattened in C order, so a (chunk, layer)
    grid of addresses becomes one row per slice.
    """
    # Each column becomes uint64 first: mixing uint64 and int64 columns would promote to float64.
    columns = np.broadcast_arrays(*(np.asarray(c, dtype=np.uint64) for c in (addrs, lengths, dev_ids)))
    return np.column_stack([column.ravel() for column in columns])


def coalesce(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge neighbouring descriptor pairs that are contiguous on both sides (same order kept).

    vLLM hands out a prompt's blocks mostly in runs, and the gateway's layer
    slices are mostly adjacent, so thousands of small transfers become a few
    large ones.
    """
    if len(local) < 2:
        return local, remote
    ends_local = local[:-1, 0] + local[:-1, 1]
    ends_remote = remote[:-1, 0] + remote[:-1, 1]
    joined = (local[1:, 0] == ends_local) & (remote[1:, 0] == ends_remote)
    joined &= (local[1:, 2] == local[:-1, 2]) & (remote[1:, 2] == remote[:-1, 2])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    merged_local, merged_remote = local[starts].copy(), remote[starts].copy()
    merged_local[:, 1] = np.add.reduceat(local[:, 1], starts)
    merged_remote[:, 1] = np.add.reduceat(remote[:, 1], starts)
    return merged_local, merged_remote


class Polling:
    """Paces one polling wait on NIXL: bounded backoff sleeps, and a deadline.

    Sleeps double from 50 µs to 1 ms while nothing happens; a poll that made
    progress (``sleep(progressed=True)``) starts over at 50 µs, so a stream of
    completions is followed closely.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._sleep_s = _MIN_SLEEP_S

    @property
    def expired(self) -> bool:
        return time.monotonic() > self._deadline

    def sleep(self, progressed: bool = False) -> None:
        self._sleep_s = _MIN_SLEEP_S if progressed else min(2 * self._sleep_s, _MAX_SLEEP_S)
        time.sleep(self._sleep_s)


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` until it is true (returns True) or ``timeout_s`` passes (returns False)."""
    polling = Polling(timeout_s)
    while not done():
        if polling.expired:
            return False
        polling.sleep()
    return True


def run_nixl_transfers(
    agent,
    op: str,
    transfers: Sequence[tuple[np.ndarray, np.ndarray]],
    remote_mem_type: str,
    timeout_s: float,
    window: int | InFlightWindow | None = None,
    local_mem_type: str = "DRAM",
) -> list[bool]:
    """Post the transfers (at most ``window`` in flight; all at once without one), wait for all; one flag each.

    An :class:`~nixl_backends.window.InFlightWindow` is asked before each post and told of each end, so the
    window follows the link's measured bandwidth-delay product.

    Each transfer is a pair of Nx3 descriptor arrays: local descriptors (DRAM,
    or VRAM for a GDS read) and the backend-side descriptors. One NIXL request per chunk lets a single
    bad chunk fail alone. A window keeps a backend's own queue short: NIXL's
    OBJ plugin runs every request of an agent on one thread pool, first come
    first served, so a write posted behind a whole hit's reads would wait for
    all of them. Raises :class:`TransferAbandoned` if any is still in flight
    after ``timeout_s``.
    """
    handles: list[Any] = [None] * len(transfers)
    ok = [False] * len(transfers)
    pending: set[int] = set()
    posted = 0
    sizer = window if isinstance(window, InFlightWindow) else None
    stamps: list[Any] = [None] * len(transfers)

    def room() -> bool:
        limit = sizer.size() if sizer is not None else window
        return limit is None or len(pending) < limit

    def post_more() -> None:
        nonlocal posted
        while posted < len(transfers) and room():
            index, posted = posted, posted + 1
            if sizer is not None:
                stamps[index] = sizer.posted()
            handle = _post(agent, op, *transfers[index], local_mem_type, remote_mem_type)
            if handle is not None:
                handles[index] = handle
                pending.add(index)

    def reap() -> int:
        """Collect the transfers that ended and post more in their place; how many ended."""
        ended = 0
        for i in list(pending):
            try:
                state = agent.check_xfer_state(handles[i])
            except Exception as exc:
                logger.debug("NIXL %s failed: %s", op, exc)
                state = "ERR"
            if state == "PROC":
                continue
            pending.discard(i)
            ok[i] = state == "DONE"
            agent.release_xfer_handle(handles[i])
            if sizer is not None:
                sizer.ended(stamps[i], int(transfers[i][0][:, 1].sum()), ok[i])
            ended += 1
        post_more()
        return ended

    polling = Polling(timeout_s)
    post_more()
    while True:
        ended = reap()
        if not pending and posted == len(transfers):
            return ok
        if polling.expired:
            # A handle still in flight cannot be released safely: NIXL may still
            # write its memory, so it is handed to the caller with the error, and
            # so is the memory (not to be reused before the handle ended).
            raise TransferAbandoned(op, len(pending), timeout_s, [handles[i] for i in pending], agent)
        # Back to the shortest sleep after a completion: with a window, the
        # next request waits on this poll to be posted.
        polling.sleep(progressed=ended > 0)


def _post(agent, op: str, local: np.ndarray, remote: np.ndarray, local_mem_type: str, remote_mem_type: str) -> Any:
    """One posted NIXL request, or None if it could not start (counted as failed)."""
    try:
        handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, local_mem_type),
                                       agent.get_xfer_descs(remote, remote_mem_type), agent.name)  # fmt: skip
        if agent.transfer(handle) == "ERR":
            agent.release_xfer_handle(handle)
            return None
        return handle
    except Exception as exc:  # NIXL raises nixlBackendError and friends per request
        logger.debug("NIXL %s could not start: %s", op, exc)
        return None
