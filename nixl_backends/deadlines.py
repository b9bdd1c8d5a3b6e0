"""The deadline of the load a store request serves, for the stores' retries.

A store that sends a failed request again (``s3``: ``io_retries`` after a backoff) must not do so past the
point where recomputing the hit would have been faster: the forward waits for the load. The caller that knows
that point (the connector's hit reader: its estimate of the hit's recompute time) sets it around its store call
with :func:`load_deadline`; the store asks :func:`seconds_left` before each retry. A context variable rather than
a parameter of every store's ``read``: one store (``tiered``, ``s3agg``'s fallback) reads through another, and
every backend would carry it only to hand it on. Unset, a store retries as configured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar

_DEADLINE: ContextVar[float | None] = ContextVar("dualpath_load_deadline", default=None)


@contextlib.contextmanager
def load_deadline(at: float | None) -> Iterator[None]:
    """Store requests in this block serve a load that must end by ``at`` (``time.monotonic()``; None: no bound)."""
    token = _DEADLINE.set(at)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def seconds_left() -> float | None:
    """Seconds until the current load's deadline (negative once past it); None when no deadline is set."""
    at = _DEADLINE.get()
    return None if at is None else at - time.monotonic()
