"""The gateway's side of a cancel (``POST /<bucket>?aggregate&cancel``, :mod:`nixl_backends.s3agg_protocol`).

A client that gave up on a NIXL request must not read anything else into its
target while a WRITE of that request can still land there (NIXL WRITEs are
one-sided: the client never sees one coming). :class:`Cancellations` knows the
running NIXL jobs by request id; a cancel stops a running job's WRITEs
(:meth:`Job.cancel`), and the id is remembered, so that a request arriving
after its cancel (delayed on the way, or still being validated) is refused
before it writes. Jobs that ended with a WRITE abandoned are kept until the
staging reaper saw that WRITE end (:meth:`Job.transfers_ended`): until then
their cancel answers that a WRITE may still land, and from then on that none
can, so a client that retired its target asks again and gets it back.

Canceled ids are bounded in count and age. A request is signed before its
cancel, and a signature is accepted at most 15 minutes either side of its date
(``sigv4``), so 30 minutes after a cancel the request it names is refused by
its signature anyway. A flood of cancels beyond the count forgets the oldest
first. Jobs whose WRITEs may still land are never forgotten while they may: a
cancel of an id this process does not know answers that nothing can land. They
are bounded by the staging memory that their abandoned transfers hold.
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
    """Running NIXL jobs by request id, the ids canceled, and the jobs ended with a WRITE that may still land."""

    def __init__(self, max_ids: int = MAX_REMEMBERED, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._max_ids = max_ids
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[str, Job] = {}
        # request id -> when canceled, oldest first.
        self._canceled: collections.OrderedDict[str, float] = collections.OrderedDict()
        # Ended jobs with a WRITE abandoned, until it ended.
        self._may_land: dict[str, Job] = {}

    def start(self, job: Job) -> None:
        """Before a job's first WRITE; a 409 if its request was canceled already or its id is in use (running, or
        ended with a WRITE that may still land)."""
        with self._lock:
            self._forget()
            if job.request_id in self._canceled:
                raise DescriptorError(409, "RequestCanceled", f"request {job.request_id} was canceled by its client")
            if job.request_id in self._running or job.request_id in self._may_land:
                raise DescriptorError(409, "RequestIdInUse", f"request {job.request_id} is running already")
            self._running[job.request_id] = job

    def end(self, job: Job) -> None:
        with self._lock:
            del self._running[job.request_id]
            if job.writes_may_land:
                self._may_land[job.request_id] = job

    def cancel(self, request_id: str, timeout_s: float) -> bool:
        """No WRITE of the request starts any more; True once none can land (a WRITE in flight ended within
        ``timeout_s``, one abandoned has ended), False while one may."""
        if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise DescriptorError(400, "InvalidArgument", f"a cancel names its request in {REQUEST_ID_HEADER}: "
                                                          f"1 to {MAX_REQUEST_ID_CHARS} characters")
        with self._lock:
            self._forget()
            self._canceled[request_id] = self._clock()
            self._canceled.move_to_end(request_id)
            while len(self._canceled) > self._max_ids:
                self._canceled.popitem(last=False)
            job = self._running.get(request_id) or self._may_land.get(request_id)
        # Outside the lock: the job's WRITE in flight may take up to the gateway's io_timeout_s.
        return job.cancel(timeout_s) if job is not None else True

    def _forget(self) -> None:
        """Canceled ids past their age; ended jobs whose abandoned WRITE ended since."""
        horizon = self._clock() - self._max_age_s
        while self._canceled and next(iter(self._canceled.values())) < horizon:
            self._canceled.popitem(last=False)
        for request_id in [r for r, job in self._may_land.items() if not job.writes_may_land]:
            del self._may_land[request_id]
