"""A rate learnt from (tokens, seconds) samples; shared by the router and the engines' read queues."""

from __future__ import annotations


class RateEstimate:
    """Tokens per second from (tokens, seconds) samples.

    Tokens and seconds are averaged separately (EWMA) and divided: averaging
    per-sample rates would let a burst of tiny samples dominate.
    """

    def __init__(self, initial_tokens_per_s: float | None, weight: float) -> None:
        self.weight = weight
        # A seed counts as one second of work at that rate; without one the
        # first sample is taken as it is.
        self._tokens = initial_tokens_per_s
        self._seconds = None if initial_tokens_per_s is None else 1.0

    @property
    def tokens_per_s(self) -> float | None:
        if self._tokens is None or self._seconds is None:
            return None
        return self._tokens / self._seconds

    def add(self, tokens: float, seconds: float) -> None:
        """One sample; empty or instantaneous samples teach nothing."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._tokens is None or self._seconds is None:
            self._tokens, self._seconds = float(tokens), float(seconds)
        else:
            self._tokens += self.weight * (tokens - self._tokens)
            self._seconds += self.weight * (seconds - self._seconds)
