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
