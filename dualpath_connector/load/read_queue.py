"""An engine's store-read queue: what it has yet to read, and how fast it reads.

The router balances the queue length (``read_queue_tokens``) between nodes.
A DE also uses it to answer a PE's read request honestly: a read that would
finish after the PE stops waiting is declined at once, so the PE reads the
hit itself straight away instead of after its deadline, and no hit crosses
both storage links.

A decline rests on the measured rate, and a declining DE reads nothing, so
one slow read (a store hiccup, a loaded host) would leave a rate that no new
read corrects: the DE would decline every read after it. So an idle DE whose
rate is older than ``RATE_PROBE_AFTER_S`` takes the next read as a probe,
whatever the rate says; the probe's own time is the fresh measurement. A probe
that still ends late doubles the wait before the next one (up to
``RATE_PROBE_MAX_AFTER_S``), so a store that really is slow costs the PE one
late read per wait, not one per request; a read taken on the rate's word
resets the wait.
"""

from __future__ import annotations

import threading
import time

from nixl_backends.rates import RateEstimate

# An idle DE's rate this old is tested by the next read (a probe) rather than trusted to decline it: about a turn's
# think time in an agent session, so a DE that declined one turn on a hiccup's rate takes the next one.
RATE_PROBE_AFTER_S = 5.0
RATE_PROBE_MAX_AFTER_S = 300.0


class StoreReadQueue:
    """Tokens queued or in flight in this engine's store reads, and the measured read rate."""

    def __init__(self, rate_weight: float = 0.3, initial_tokens_per_s: float | None = None) -> None:
        self._lock = threading.Lock()
        self._queued_tokens = 0
        # Unseeded (an engine's), nothing is declined before the first read is measured.
        self._read_rate = RateEstimate(initial_tokens_per_s, rate_weight)
        self._reading = 0  # store reads running now
        self._credited_until = 0.0  # while reads run: the end of the time already credited to finished reads
        # When the rate last learnt from a read (a seed counts as learnt now).
        self._measured_at = None if initial_tokens_per_s is None else time.perf_counter()
        self._probe_after_s = RATE_PROBE_AFTER_S  # how old the rate of an idle queue may be before a probe
        self._probed = False  # a probe was let through since the last read the rate accepted

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def tokens_per_s(self) -> float | None:
        """Measured store read rate; None until a read finished."""
        return self._read_rate.tokens_per_s

    def add(self, tokens: int) -> int:
        """Count ``tokens`` in (negative: out); the new length."""
        with self._lock:
            self._queued_tokens += tokens
            return self._queued_tokens

    def read_started(self) -> None:
        """A store read begins; end it with :meth:`read_finished`, also when it fails."""
        with self._lock:
            if self._reading == 0:
                self._credited_until = time.perf_counter()
            self._reading += 1

    def read_finished(self, tokens: int) -> None:
        """A store read ended, having read ``tokens``.

        They are credited with the time since the last read ended (or since
        reads began): time with no read running counts for nothing, and with
        several reads at once the rate is what the link moves, not what one
        read moves, so the queue drains at it. A failed read (no tokens)
        teaches nothing and its time is not charged to the next one.
        """
        with self._lock:
            now = time.perf_counter()
            if tokens > 0 and now > self._credited_until:
                self._measured_at = now
            self._read_rate.add(tokens, now - self._credited_until)
            self._credited_until = now
            self._reading -= 1

    def decline_reason(self, tokens: int, time_left_s: float, tokens_ahead: int | None = None) -> str | None:
        """Why a read of ``tokens`` would end after ``time_left_s``; None if it should make it.

        The read ends once ``tokens_ahead`` (default: the whole queue now) and
        its own tokens are read at the measured rate. Before the first read
        is measured nothing is declined, and neither is a probe: a read with
        nothing ahead of it, on an idle link, whose rate is older than the
        probe wait (the module's docstring).
        """
        with self._lock:
            rate = self._read_rate.tokens_per_s
            if rate is None:
                return None
            ahead = self._queued_tokens if tokens_ahead is None else tokens_ahead
            expected_s = (ahead + tokens) / rate
            if expected_s <= time_left_s:
                self._probed = False
                self._probe_after_s = RATE_PROBE_AFTER_S
                return None
            idle = ahead == 0 and self._reading == 0
            if idle and self._measured_at is not None and time.perf_counter() - self._measured_at >= self._probe_after_s:
                self._probed = True
                return None
            if idle and self._probed:
                # The last probe's own time still says late: the store is slow, not the estimate stale.
                self._probed = False
                self._probe_after_s = min(2 * self._probe_after_s, RATE_PROBE_MAX_AFTER_S)
        return (
            f"{ahead} tokens queued ahead; at {rate:.0f} tokens/s this read would end in "
            f"{expected_s:.1f}s, {time_left_s:.1f}s are left"
        )
