"""The gateway's cancel bookkeeping: canceled ids (bounded in count and age) refuse late requests, and a cancel
says "stopped" only once no WRITE of the request is in flight and none that was abandoned can still land."""

from __future__ import annotations

import pytest

from nixl_backends.nixl_io import TransferAbandoned
from s3agg_gateway_ext.aggregator import Job, RequestCanceled
from s3agg_gateway_ext.cancellation import MAX_REQUEST_ID_CHARS, Cancellations
from s3agg_gateway_ext.descriptor import DescriptorError


def job(request_id: str) -> Job:
    # Only the request id and the WRITE state matter here.
    return Job(request_id, desc=None, mode="layerwise", io=None, remote_agent=None, flow=None)


def refused(cancellations: Cancellations, request_id: str) -> str | None:
    """The code a job of ``request_id`` is refused with at its start, or None (then it runs, and ends)."""
    started = job(request_id)
    try:
        cancellations.start(started)
    except DescriptorError as exc:
        assert exc.status == 409
        return exc.code
    cancellations.end(started)
    return None


def test_a_request_arriving_after_its_cancel_is_refused():
    cancellations = Cancellations()
    assert cancellations.cancel("late", timeout_s=1.0) is True  # nothing ran: nothing can land
    assert refused(cancellations, "late") == "RequestCanceled"
    assert refused(cancellations, "other") is None


def test_canceled_ids_are_bounded_in_count_oldest_forgotten_first():
    cancellations = Cancellations(max_ids=2)
    for request_id in ("a", "b", "c"):
        cancellations.cancel(request_id, timeout_s=1.0)
    assert [refused(cancellations, r) for r in ("a", "b", "c")] == [None, "RequestCanceled", "RequestCanceled"]


def test_canceled_ids_are_forgotten_after_max_age():
    now = [0.0]
    cancellations = Cancellations(max_age_s=10.0, clock=lambda: now[0])
    cancellations.cancel("a", timeout_s=1.0)
    now[0] = 9.0
    cancellations.cancel("b", timeout_s=1.0)
    assert refused(cancellations, "a") == "RequestCanceled"
    now[0] = 10.5
    assert [refused(cancellations, r) for r in ("a", "b")] == [None, "RequestCanceled"]


def test_a_running_request_id_is_not_started_twice():
    cancellations = Cancellations()
    cancellations.start(job("r"))
    assert refused(cancellations, "r") == "RequestIdInUse"


def test_a_cancel_names_a_request_of_bounded_length():
    with pytest.raises(DescriptorError) as too_long:
        Cancellations().cancel("x" * (MAX_REQUEST_ID_CHARS + 1), timeout_s=1.0)
    assert (too_long.value.status, too_long.value.code) == (400, "InvalidArgument")


def test_a_canceled_job_starts_no_write():
    cancellations, running = Cancellations(), job("r")
    cancellations.start(running)
    with running.write():
        pass  # a WRITE before the cancel
    assert cancellations.cancel("r", timeout_s=1.0) is True
    with pytest.raises(RequestCanceled), running.write():
        pytest.fail("a WRITE started after the cancel")


def test_stopped_only_once_the_write_in_flight_ended():
    cancellations, running = Cancellations(), job("r")
    cancellations.start(running)
    with running.write():
        # The WRITE does not end within the cancel's wait: not stopped.
        assert cancellations.cancel("r", timeout_s=0.01) is False
    assert cancellations.cancel("r", timeout_s=1.0) is True


def test_an_abandoned_write_is_never_stopped_also_after_its_job_ended():
    cancellations, running = Cancellations(), job("r")
    cancellations.start(running)
    with pytest.raises(TransferAbandoned), running.write():
        raise TransferAbandoned("WRITE", 1, 0.0)
    assert running.write_abandoned and not running.write_in_flight
    assert cancellations.cancel("r", timeout_s=1.0) is False
    cancellations.end(running)
    assert cancellations.cancel("r", timeout_s=1.0) is False
    # Control: a job that ended with its WRITEs done is stopped.
    done = job("done")
    cancellations.start(done)
    with done.write():
        pass
    cancellations.end(done)
    assert cancellations.cancel("done", timeout_s=1.0) is True


def abandoned_job(cancellations: Cancellations, request_id: str) -> Job:
    """A job that ended with a WRITE abandoned (still in flight as far as anyone knows)."""
    running = job(request_id)
    cancellations.start(running)
    with pytest.raises(TransferAbandoned), running.write():
        raise TransferAbandoned("WRITE", 1, 0.0)
    cancellations.end(running)
    return running


def test_an_abandoned_write_that_ended_is_stopped_and_its_id_free_again():
    cancellations = Cancellations()
    ended_late = abandoned_job(cancellations, "r")
    assert cancellations.cancel("r", timeout_s=1.0) is False
    ended_late.transfers_ended()  # the staging reaper saw the WRITE end
    assert cancellations.cancel("r", timeout_s=1.0) is True  # the client that retired its target gets it back
    # Ended before anyone asked: not kept at all.
    ended_first = abandoned_job(cancellations, "s")
    ended_first.transfers_ended()
    assert refused(cancellations, "s") is None
    assert cancellations.cancel("s", timeout_s=1.0) is True


def test_a_write_that_may_land_is_never_forgotten_by_count_or_age():
    """A forgotten id would be unknown, and a cancel of an unknown id answers stopped: a late WRITE would land in a
    buffer the client reused."""
    now = [0.0]
    cancellations = Cancellations(max_ids=2, max_age_s=10.0, clock=lambda: now[0])
    abandoned_job(cancellations, "r")
    assert cancellations.cancel("r", timeout_s=1.0) is False
    for flood in range(5):
        cancellations.cancel(f"flood-{flood}", timeout_s=1.0)
    now[0] = 3600.0
    assert cancellations.cancel("r", timeout_s=1.0) is False
    assert refused(cancellations, "r") == "RequestCanceled"
    # Control: an id that only was canceled is forgotten by the same flood and age.
    cancellations.cancel("plain", timeout_s=1.0)
    for flood in range(5):
        cancellations.cancel(f"flood2-{flood}", timeout_s=1.0)
    assert refused(cancellations, "plain") is None
