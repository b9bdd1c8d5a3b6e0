"""IOLane: jobs started in order, up to ``threads`` at once; repairs first; stop finishes what is queued."""

from __future__ import annotations

import threading

from dualpath_connector.lanes.io_lanes import REPAIR_PRIORITY, IOLane

PATIENT_S = 30.0


def test_a_lane_of_two_runs_two_jobs_at_once():
    lane = IOLane("test", None, threads=2)
    both = threading.Barrier(2, timeout=PATIENT_S)  # each job waits for the other: only concurrent jobs pass
    passed = []
    try:
        for _ in range(2):
            lane.submit(lambda: passed.append(both.wait()))
    finally:
        assert lane.stop(PATIENT_S)
    assert sorted(passed) == [0, 1]


def test_a_lane_of_one_runs_one_job_after_another():
    # Control: the same two jobs on one thread never meet (the barrier breaks for the first, then the second).
    lane = IOLane("test", None, threads=1)
    both = threading.Barrier(2, timeout=0.5)
    broken = []

    def job() -> None:
        try:
            both.wait()
        except threading.BrokenBarrierError:
            broken.append(True)

    lane.submit(job)
    lane.submit(job)
    assert lane.stop(PATIENT_S)
    assert broken == [True, True]


def test_a_repair_jumps_the_queue():
    lane = IOLane("test", None, threads=1)
    release = threading.Event()
    order: list[str] = []
    lane.submit(lambda: release.wait(PATIENT_S))  # the thread is busy while the rest queue
    for name in ("a", "b"):
        lane.submit(lambda name=name: order.append(name))
    lane.submit(lambda: order.append("repair"), REPAIR_PRIORITY)  # what run_now queues
    release.set()
    assert lane.stop(PATIENT_S)
    assert order == ["repair", "a", "b"]


def test_stop_finishes_what_is_queued_on_every_thread():
    lane = IOLane("test", None, threads=2)
    release = threading.Event()
    ran: list[int] = []
    for _ in range(2):
        lane.submit(lambda: release.wait(PATIENT_S))
    for i in range(5):
        lane.submit(lambda i=i: ran.append(i))
    release.set()
    assert lane.stop(PATIENT_S)
    assert sorted(ran) == list(range(5))
