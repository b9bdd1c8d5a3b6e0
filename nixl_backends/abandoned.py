"""Memory that abandoned NIXL transfers may still touch, freed once they all ended.

A transfer still in flight at its deadline (:class:`~nixl_backends.nixl_io.TransferAbandoned`) may write its
destination (a READ) or read its source (a WRITE) at any later time, so that memory can be neither reused nor
freed then: a late store answer must never land in a buffer that holds another request's KV. It is not kept
forever either: :class:`AbandonedTransfers` holds it with the transfers' NIXL handles, polls those handles on
a thread of its own, and frees the memory (returns pool slots, deregisters, closes descriptors) once every one
of them has ended. Transfers another process runs (an s3agg gateway's WRITEs into this process's buffer) have
no handle here: a probe asks that process whether none of them can land any more, at growing intervals
(:data:`PROBE_FIRST_S` doubling up to :data:`PROBE_MAX_S`: each probe is a request to it), and the memory is
freed once it confirms. A transfer that never ends, or whose end cannot be confirmed, keeps its memory for
good: its owner then has less to give out and refuses work (a pool with no room is a miss) instead of growing
or reusing.

The engine's hit reader and chunk saver share one per process (:func:`process_reaper`); the gateway keeps
its own, for the staging budget it reports.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nixl_backends.nixl_io import TransferAbandoned

logger = logging.getLogger(__name__)

# A probe is a request to another process: the first one after the caller's own failed attempt, then at doubling
# intervals up to the last (a gateway cut off for hours is asked once a minute).
PROBE_FIRST_S = 1.0
PROBE_MAX_S = 60.0


@dataclass
class _Held:
    agent: Any
    handles: list[Any]
    # The buffer itself, where the caller's reference may end first: kept so that it outlives every transfer.
    memory: Any
    free: Callable[[], None]
    nbytes: int
    label: str
    # Transfers another process runs: asked, not polled (True once none can land any more).
    probe: Callable[[], bool] | None = None
    probe_at: float = 0.0
    probe_wait_s: float = PROBE_FIRST_S


class AbandonedTransfers:
    """Frees memory held for abandoned NIXL transfers once every one of them has ended (a thread of its own)."""

    def __init__(self, name: str = "nixl-abandoned", poll_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._poll_s = poll_s
        self._clock = clock
        self._held: list[_Held] = []
        self._changed = threading.Condition()
        # One reap at a time: two would both see an entry's transfers ended and free it twice.
        self._reaping = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        with self._changed:
            return sum(entry.nbytes for entry in self._held)

    @property
    def held(self) -> int:
        with self._changed:
            return len(self._held)

    def hold(self, agent: Any, handles: Sequence[Any], free: Callable[[], None], *, nbytes: int = 0,
             label: str = "", memory: Any = None, probe: Callable[[], bool] | None = None) -> None:
        """Keep ``memory`` (``nbytes`` of it) until ``handles`` of ``agent`` have ended, then call ``free``.

        Without handles, until ``probe`` returns True (the process running the transfers confirms that none can
        land any more); without either it is kept for good: nothing says when the transfers end.
        """
        watched = bool(handles) and agent is not None
        if not watched and probe is None:
            logger.error("%s: abandoned transfers that cannot be watched; %d bytes are never freed", label, nbytes)
            return
        entry = _Held(agent, list(handles) if watched else [], memory, free, nbytes, label)
        if not watched:
            entry.probe, entry.probe_at = probe, self._clock() + PROBE_FIRST_S
        with self._changed:
            self._held.append(entry)
            self._changed.notify_all()

    def hold_abandoned(self, exc: TransferAbandoned, free: Callable[[], None], *, nbytes: int = 0,
                       label: str = "", memory: Any = None) -> None:
        """Hold what ``exc`` abandoned: its layers' cleanups (:meth:`TransferAbandoned.when_ended`), then ``free``."""
        cleanups = [*exc.cleanups, free]

        def free_all() -> None:
            for cleanup in cleanups:
                cleanup()

        self.hold(exc.agent, exc.handles, free_all, nbytes=nbytes, label=label, memory=memory, probe=exc.probe)

    def reap(self) -> int:
        """Free every held entry whose transfers all ended; how many were freed."""
        with self._reaping:
            with self._changed:
                held = list(self._held)
            done = [entry for entry in held if self._ended(entry)]
            for entry in done:
                try:
                    entry.free()
                except Exception:  # one failing cleanup must not keep the rest held for ever
                    logger.exception("%s: freeing what abandoned transfers held failed", entry.label)
                entry.memory = None
                logger.warning("%s: abandoned transfers ended; %d bytes freed", entry.label, entry.nbytes)
            with self._changed:
                self._held = [entry for entry in self._held if entry not in done]
            return len(done)

    def _ended(self, entry: _Held) -> bool:
        """True once no handle is in flight (the ended ones are released as they are seen), or the probe, when
        due, confirms that none can land."""
        if entry.probe is not None:
            return self._probed(entry)
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

    def _probed(self, entry: _Held) -> bool:
        now = self._clock()
        if now < entry.probe_at:
            return False
        try:
            if entry.probe():
                return True
        except Exception:  # a probe that fails confirms nothing: asked again later
            logger.exception("%s: asking whether abandoned transfers ended failed", entry.label)
        entry.probe_wait_s = min(2 * entry.probe_wait_s, PROBE_MAX_S)
        entry.probe_at = self._clock() + entry.probe_wait_s
        return False

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


_process_reaper: tuple[int, AbandonedTransfers] | None = None
_process_reaper_lock = threading.Lock()


def process_held_bytes() -> int:
    """Bytes :func:`process_reaper` holds now (0 before it was needed: no thread is started to say so)."""
    with _process_reaper_lock:
        reaper = _process_reaper[1] if _process_reaper is not None and _process_reaper[0] == os.getpid() else None
    return 0 if reaper is None else reaper.held_bytes


def process_reaper() -> AbandonedTransfers:
    """This process's reaper for the engine's buffers (started on first use, again after a fork: a forked
    child has none of its parent's threads)."""
    global _process_reaper
    with _process_reaper_lock:
        if _process_reaper is None or _process_reaper[0] != os.getpid():
            _process_reaper = (os.getpid(), AbandonedTransfers())
        return _process_reaper[1]


def retire_slots(exc: TransferAbandoned, pool: Any, slots: list[int], what: str) -> None:
    """NIXL may still touch ``slots`` of ``pool`` (a HostBufferPool): logged, and held by :func:`process_reaper`
    until ``exc``'s transfers ended, then released to the pool."""
    logger.error("%s: store transfer abandoned; %d slots retired until its transfers end", what, len(slots))
    process_reaper().hold_abandoned(exc, lambda: pool.release(slots), nbytes=len(slots) * pool.slot_bytes,
                                    label=f"{what}: {len(slots)} slots")
