"""I/O lanes: one per link, each running its NIXL jobs in order, on one thread or a few.

A worker has three, because its jobs use three different links and must not
wait for each other: store reads (the storage NIC's receive side), store
writes (its send side) and pulls between engines (the compute network). On
one thread a DE's reads for a PE held up its saves and its pulls of prefilled
prompts, and the agents' next turns waited for them. The read lane runs
``store_reads_in_flight`` jobs at once, started in order: a read's gaps (its
verification, its last object) no longer leave the link idle.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from dualpath_connector.lanes.affinity import pin_current_thread

logger = logging.getLogger(__name__)

# A repair blocks a forward, so it jumps its lane's queue.
REPAIR_PRIORITY, JOB_PRIORITY, _STOP_PRIORITY = -1, 0, 1


class IOLane:
    """``threads`` threads that start jobs in order (repairs first), up to ``threads`` at once."""

    def __init__(self, name: str, cores: set[int] | None, threads: int = 1) -> None:
        self.name = name
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._cores = cores
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}" if threads > 1 else name, daemon=True)
                         for i in range(threads)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], None], priority: int = JOB_PRIORITY) -> None:
        self._queue.put((priority, next(self._order), job))

    def run_now(self, job: Callable[[], None], timeout_s: float | None = None) -> bool:
        """Run ``job`` ahead of queued jobs and wait for it, at most ``timeout_s`` (repairs on a forward's
        critical path); False if it had not ended by then: it still runs, so it must make a late end harmless."""
        done = threading.Event()

        def wrapped() -> None:
            try:
                job()
            finally:
                done.set()

        self.submit(wrapped, REPAIR_PRIORITY)
        return done.wait(timeout_s)

    def _run(self) -> None:
        pin_current_thread(self._cores)
        while True:
            priority, _, job = self._queue.get()
            if priority == _STOP_PRIORITY:
                return
            try:
                job()
            except Exception:  # a job reports its own failures; this keeps the thread alive
                logger.exception("%s job failed", self.name)

    def stop(self, timeout_s: float) -> bool:
        """Finish queued work and stop; False if a thread is still running after ``timeout_s``."""
        # Queued after every pending job (one per thread: each takes one and ends), so pending saves still
        # reach the store.
        for _ in self._threads:
            self.submit(lambda: None, _STOP_PRIORITY)
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)
