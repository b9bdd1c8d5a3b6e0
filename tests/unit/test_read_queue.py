"""StoreReadQueue: the queue length the router balances and the DE's decline-at-once decision."""

from __future__ import annotations

import pytest

from dualpath_connector.read_queue import StoreReadQueue


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


def test_a_read_behind_a_long_queue_is_declined_with_the_numbers():
    queue = StoreReadQueue(rate_weight=0.5)
    queue.record_read(1000, 2.0)
    queue.record_read(3000, 2.0)  # EWMA: 2000 tokens in 2 s
    assert queue.tokens_per_s == pytest.approx(1000.0)
    queue.add(4000)
    # 4000 queued + 5000 = 9 s at 1000 tokens/s.
    assert queue.decline_reason(5000, 10.0) is None
    reason = queue.decline_reason(7000, 10.0)
    assert reason is not None and "4000 tokens queued ahead" in reason and "11.0s" in reason


def test_at_its_turn_a_read_is_judged_by_the_time_left_alone():
    queue = StoreReadQueue()
    queue.record_read(1000, 1.0)
    queue.add(50_000)
    assert queue.decline_reason(2000, 3.0, tokens_ahead=0) is None
    assert "2.0s, 1.5s are left" in queue.decline_reason(2000, 1.5, tokens_ahead=0)


def test_empty_or_instant_reads_teach_nothing():
    queue = StoreReadQueue()
    queue.record_read(0, 1.0)
    queue.record_read(100, 0.0)
    assert queue.tokens_per_s is None
