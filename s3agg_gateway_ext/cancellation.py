"""The gateway's side of a cancel (``POST /<bucket>?aggregate&cancel``, :mod:`nixl_backends.s3agg_protocol`).

A client that gave up on a NIXL request must not read anything else into its
target while a WRITE of that request can still land there (NIXL WRITEs are
one-sided: the client never sees one coming). :class:`Cancellations` knows the
running NIXL jobs by request id; a cancel stops a running job's WRITEs
(:meth:`Job.cancel`), and the id is remembered, so that a request arriving
after its cancel (delayed on the way, or still being validated) is refused
before it writes. Ids of jobs that ended with a WRITE abandoned are remembered
too: their cancel must answer that a WRITE may still land.

Remembered ids are bounded in count and age. A request is signed before its
cancel, and a signature is accepted at most 15 minutes either side of its date
(``sigv4``), so 30 minutes after a cancel the request it names is refused by
its signature anyway. A flood of cancels beyond the count forgets the oldest
first.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from nixl_backends.s3agg_protocol import REQUEST_ID_HEADER
from s3agg_gateway_ext.aggregator import Job
from s3agg_gateway_ext.descriptor import DescriptorError

MAX_REMEMBERED = 1 << 16
MAX_AGE_S = 30 * 60.0
# Longer ids are refused by the cancel: remembered ids are what bounds its memory.
MAX_REQUEST_ID_CHARS = 256


class Cancellations:
    """Running NIXL jobs by request id, and the ids canceled or ended with a WRITE that may still land."""

    def __init__(self, max_ids: int = MAX_REMEMBERED, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._max_ids = max_ids
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[str, Job] = {}
        # request id -> (when remembered, whether a WRITE of it may still land), oldest first.
        self._remembered: collections.OrderedDict[str, tuple[float, bool]] = collections.OrderedDict()

    def start(self, job: Job) -> None:
        """Before a job's first WRITE; a 409 if its request was canceled already or its id is running."""
        with self._lock:
            self._forget_old()
            if job.request_id in self._remembered:
                raise DescriptorError(409, "RequestCanceled", f"request {job.request_id} was canceled by its client")
            if job.request_id in self._running:
                raise DescriptorError(409, "RequestIdInUse", f"request {job.request_id} is running already")
            self._running[job.request_id] = job

    def end(self, job: Job) -> None:
        with self._lock:
            del self._running[job.request_id]
            if job.write_abandoned:
                self._remember(job.request_id, True)

    def cancel(self, request_id: str, timeout_s: float) -> bool:
        """No WRITE of the request starts any more; True once none can land (a WRITE in flight ended within
        ``timeout_s``), False while one may (abandoned, or still in flight)."""
        if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise DescriptorError(400, "InvalidArgument", f"a cancel names its request in {REQUEST_ID_HEADER}: "
                                                          f"1 to {MAX_REQUEST_ID_CHARS} characters")
        with self._lock:
            self._forget_old()
            may_land = self._remembered.get(request_id, (0.0, False))[1]
            self._remember(request_id, may_land)
            job = self._running.get(request_id)
        # Outside the lock: the job's WRITE in flight may take up to the gateway's io_timeout_s.
        return job.cancel(timeout_s) if job is not None else not may_land

    def _remember(self, request_id: str, may_land: bool) -> None:
        self._remembered[request_id] = (self._clock(), may_land)
        self._remembered.move_to_end(request_id)
        while len(self._remembered) > self._max_ids:
            self._remembered.popitem(last=False)

    def _forget_old(self) -> None:
        horizon = self._clock() - self._max_age_s
        while self._remembered and next(iter(self._remembered.values()))[0] < horizon:
            self._remembered.popitem(last=False)
