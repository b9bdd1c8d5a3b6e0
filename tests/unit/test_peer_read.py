"""PeerRead (nixl_backends/transport.py) never reports a READ failed while it can still write local memory.

A fake NIXL agent stands in for a peer that does not answer in time (a real UCX READ on loopback cannot be
held in flight on demand). Its READ is "PROC" until told otherwise; releasing its handle cancels it, or is
refused (NIXL keeps the handle) a given number of times first.
"""

from __future__ import annotations

import pytest

from nixl_backends import transport
from nixl_backends.transport import PeerRead


class FakeAgent:
    def __init__(self, refusals: int = 0, done_after_checks: int | None = None) -> None:
        self.refusals = refusals
        self.done_after_checks = done_after_checks
        self.checks = 0
        self.released = 0
        self.canceled = False

    def check_xfer_state(self, handle) -> str:
        self.checks += 1
        if self.canceled:
            raise AssertionError("a canceled handle was checked again")
        if self.done_after_checks is not None and self.checks >= self.done_after_checks:
            return "DONE"
        return "PROC"

    def release_xfer_handle(self, handle) -> None:
        state = "DONE" if self.done_after_checks is not None and self.checks >= self.done_after_checks else "PROC"
        if state == "PROC" and self.refusals:
            self.refusals -= 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released += 1
        self.canceled = state == "PROC"


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(transport, "CANCEL_RETRY_S", 0.01)


def test_a_read_that_ends_in_time_is_done_and_released_once():
    agent = FakeAgent(done_after_checks=2)
    assert PeerRead(agent, "h").wait(5.0)
    assert agent.released == 1 and not agent.canceled


def test_a_read_still_running_at_the_deadline_is_canceled_before_wait_says_false():
    agent = FakeAgent()
    read = PeerRead(agent, "h")
    assert not read.wait(0.05)
    assert agent.canceled and agent.released == 1
    assert read.state() == "CANCELED"  # and never checked again
    read.cancel()  # a second cancel is a no-op
    assert agent.released == 1


def test_a_read_nixl_cannot_cancel_yet_is_retried_until_canceled():
    agent = FakeAgent(refusals=3)
    assert not PeerRead(agent, "h").wait(0.05)
    assert agent.refusals == 0 and agent.canceled  # refused three times, then canceled: only then False


def test_a_read_that_ends_while_cancels_are_refused_counts_its_bytes():
    # Control for the above: the same refusals, but the READ completes meanwhile: its bytes are here.
    agent = FakeAgent(refusals=100, done_after_checks=30)
    assert PeerRead(agent, "h").wait(0.01)
    assert not agent.canceled and agent.released == 1
