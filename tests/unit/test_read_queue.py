"""StoreReadQueue: the queue length the router balances and the DE's decline-at-once decision."""

from __future__ import annotations

import pytest

from dualpath_connector.load import read_queue as read_queue_module
from dualpath_connector.load.read_queue import StoreReadQueue


@pytest.fixture
def clock(monkeypatch):
    """The queue's clock, set by the test: ``clock.now = t``."""

    class Clock:
        now = 0.0

    monkeypatch.setattr(read_queue_module.time, "perf_counter", lambda: Clock.now)
    return Clock


def read(queue: StoreReadQueue, clock, start: float, end: float, tokens: int) -> None:
    clock.now = start
    queue.read_started()
    clock.now = end
    queue.read_finished(tokens)


def test_queue_length_counts_in_and_out():
    queue = StoreReadQueue()
    assert queue.add(300) == 300
    assert queue.add(200) == 500
    assert queue.add(-300) == 200
    assert queue.queued_tokens == 200


def test_nothing_is_declined_before_a_read_was_measured():
    queue = StoreReadQueue()
    queue.add(10**9)
    assert queue.tokens_per_s is None
    assert queue.decline_reason(1000, 0.001) is None


def test_a_read_behind_a_long_queue_is_declined_with_the_numbers(clock):
    queue = StoreReadQueue(rate_weight=0.5)
    read(queue, clock, 0.0, 2.0, 1000)
    read(queue, clock, 10.0, 12.0, 3000)  # EWMA: 2000 tokens in 2 s; the idle 8 s between count for nothing
    assert queue.tokens_per_s == pytest.approx(1000.0)
    queue.add(4000)
    # 4000 queued + 5000 = 9 s at 1000 tokens/s.
    assert queue.decline_reason(5000, 10.0) is None
    reason = queue.decline_reason(7000, 10.0)
    assert reason is not None and "4000 tokens queued ahead" in reason and "11.0s" in reason


def test_reads_at_once_are_measured_by_what_the_link_moved(clock):
    """Two reads of 1000 tokens start together and end after 1 s and 2 s: 2000 tokens in the 2 s the link was
    busy, 1000 tokens/s. Timed one by one (1 s and 2 s each) they would say 667: the queue would seem to drain
    slower than it does, and a DE would decline reads it can finish."""
    queue = StoreReadQueue(rate_weight=0.5)
    queue.read_started()
    queue.read_started()
    clock.now = 1.0
    queue.read_finished(1000)
    clock.now = 2.0
    queue.read_finished(1000)
    assert queue.tokens_per_s == pytest.approx(1000.0)
    # A read starting while one runs is not charged for time before it: the busy time is shared out once.
    clock.now = 10.0
    queue.read_started()
    clock.now = 11.0
    queue.read_started()
    clock.now = 12.0
    queue.read_finished(2000)  # 2000 tokens for the 2 s since reads began
    clock.now = 13.0
    queue.read_finished(1000)
    assert queue.tokens_per_s == pytest.approx(1000.0)


def test_at_its_turn_a_read_is_judged_by_the_time_left_alone(clock):
    queue = StoreReadQueue()
    read(queue, clock, 0.0, 1.0, 1000)
    queue.add(50_000)
    assert queue.decline_reason(2000, 3.0, tokens_ahead=0) is None
    assert "2.0s, 1.5s are left" in queue.decline_reason(2000, 1.5, tokens_ahead=0)


def test_failed_empty_or_instant_reads_teach_nothing(clock):
    queue = StoreReadQueue()
    read(queue, clock, 0.0, 5.0, 0)  # failed: its 5 s are not charged to the next read
    read(queue, clock, 5.0, 5.0, 100)
    assert queue.tokens_per_s is None
    read(queue, clock, 6.0, 7.0, 1000)
    assert queue.tokens_per_s == pytest.approx(1000.0)


def test_an_idle_queue_probes_a_stale_rate_instead_of_declining_for_ever(clock):
    """One slow read (a store hiccup) leaves a rate that declines the next reads, and a declining DE reads
    nothing that could correct it. Once the rate is RATE_PROBE_AFTER_S old, an idle queue takes the next read
    as a probe; the probe's fast time restores the rate and reads are taken on its word again."""
    queue = StoreReadQueue(rate_weight=0.5)
    read(queue, clock, 0.0, 10.0, 1000)  # 100 tokens/s: a 1000-token read "needs" 10 s
    clock.now = 11.0
    assert "10.0s, 5.0s are left" in queue.decline_reason(1000, 5.0)
    clock.now = 10.0 + read_queue_module.RATE_PROBE_AFTER_S
    assert queue.decline_reason(1000, 5.0) is None  # the probe
    assert queue.decline_reason(1000, 5.0, tokens_ahead=0) is None  # and at its turn, still the probe
    read(queue, clock, clock.now, clock.now + 0.1, 1000)  # the store is fast again: ~200 tokens/s by the EWMA
    assert queue.decline_reason(1000, 6.0) is None  # not a probe (the rate is fresh): the rate's word


def test_a_probe_is_never_a_read_behind_others(clock):
    queue = StoreReadQueue()
    read(queue, clock, 0.0, 10.0, 1000)
    clock.now = 100.0
    queue.add(1000)  # another read queued ahead: its time, not a stale rate, decides
    assert queue.decline_reason(1000, 5.0) is not None
    queue.add(-1000)
    clock.now = 100.0
    queue.read_started()  # one running: the link is not idle
    assert queue.decline_reason(1000, 5.0) is not None


def test_probes_that_stay_late_back_off(clock):
    """A store that really is slow: each probe's own time says late again, so the wait before the next probe
    doubles (a PE pays one late read per wait, not one per request); a read the rate accepts resets it."""
    after = read_queue_module.RATE_PROBE_AFTER_S
    queue = StoreReadQueue(rate_weight=1.0)
    read(queue, clock, 0.0, 10.0, 1000)
    end = 10.0
    for wait in (after, 2 * after, 4 * after):
        clock.now = end + wait - 0.01
        assert queue.decline_reason(1000, 5.0) is not None, wait
        clock.now = end + wait
        assert queue.decline_reason(1000, 5.0) is None, wait  # probe
        end = clock.now + 10.0
        read(queue, clock, clock.now, end, 1000)  # as slow as before
        assert queue.decline_reason(1000, 5.0) is not None
    assert queue.decline_reason(100, 5.0) is None  # short enough on the rate's word: the wait resets
    clock.now = end + after
    assert queue.decline_reason(1000, 5.0) is None


def test_a_seeded_rate_is_probed_once_it_is_old(clock):
    clock.now = 0.0
    queue = StoreReadQueue(initial_tokens_per_s=100.0)
    assert queue.decline_reason(1000, 5.0) is not None
    clock.now = read_queue_module.RATE_PROBE_AFTER_S
    assert queue.decline_reason(1000, 5.0) is None
