"""AbandonedTransfers: memory that abandoned NIXL transfers may still touch is freed once (and only once) every
one of them ended, with what each layer they passed through could not free; never while one runs.

The NIXL agent is a stand-in whose transfer states the test sets: that is the point (a transfer that outlived its
deadline, then ends). The gateway's use is in ``tests/integration/test_s3agg_gateway.py``, a hit reader's in
``test_read_moves.py``."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest

from nixl_backends.abandoned import PROBE_MAX_S, AbandonedTransfers
from nixl_backends.nixl_io import TransferAbandoned
from s3agg_gateway_ext.staging import StagingBudget, StagingBusy


class HeldTransfers:
    """A NIXL agent's transfer bookkeeping whose states the test sets: handle -> "PROC" | "DONE" | "ERR"."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states = states
        self.released: list[str] = []

    def check_xfer_state(self, handle: str) -> str:
        if self.states[handle] == "ERR":
            raise RuntimeError("nixlBackendError")  # NIXL raises for a failed transfer
        return self.states[handle]

    def release_xfer_handle(self, handle: str) -> None:
        assert handle not in self.released, "a handle released twice"
        self.released.append(handle)


@pytest.fixture
def reaper():
    reaper = AbandonedTransfers(poll_s=3600.0)  # reaped by hand here, not by its thread's next round
    yield reaper
    reaper.close()


def test_abandoned_memory_is_freed_only_once_every_transfer_ended(reaper):
    budget = StagingBudget(1000)
    budget.take(400, timeout_s=0.0)
    agent, freed = HeldTransfers({"read": "PROC", "write": "PROC"}), []

    def free() -> None:
        freed.append(True)
        budget.give_back(400)

    memory = np.empty(400, dtype=np.uint8)
    alive = weakref.ref(memory)
    reaper.hold(agent, ["read", "write"], free, nbytes=400, label="r1", memory=memory)
    del memory  # the caller's reference ends with its request: the reaper's keeps the buffer
    assert reaper.reap() == 0 and not freed and agent.released == []
    assert alive() is not None
    agent.states["read"] = "ERR"  # a failed transfer ended too; its handle is released at once
    assert reaper.reap() == 0 and not freed and agent.released == ["read"]
    assert (budget.in_use, reaper.held_bytes) == (400, 400)
    agent.states["write"] = "DONE"
    assert reaper.reap() == 1 and freed == [True] and agent.released == ["read", "write"]
    assert (budget.in_use, reaper.held_bytes, reaper.held) == (0, 0, 0) and alive() is None
    assert reaper.reap() == 0  # nothing is freed twice


def test_abandoned_staging_is_freed_only_once_every_transfer_ended_with_concurrent_reaps(reaper):
    """Two reaps at once (the thread's round and a caller's) both seeing the transfers ended free once."""
    agent, freed = HeldTransfers({"read": "DONE"}), []
    reaper.hold(agent, ["read"], lambda: freed.append(True), label="r1")
    threads = [threading.Thread(target=reaper.reap) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert freed == [True] and agent.released == ["read"]


def test_control_memory_whose_transfer_never_ends_stays_held(reaper):
    budget = StagingBudget(500)
    budget.take(400, timeout_s=0.0)
    agent, freed = HeldTransfers({"read": "PROC"}), []
    reaper.hold(agent, ["read"], lambda: freed.append(True), nbytes=400, label="r1", memory=bytearray(400))
    assert reaper.reap() == 0 and not freed
    with pytest.raises(StagingBusy):  # the gateway refuses work instead of reusing or growing
        budget.take(200, timeout_s=0.0)


def test_what_each_layer_could_not_free_runs_innermost_first_once_the_transfers_ended(reaper):
    """A store names its registration, the reader its slots: deregistered before the slots go back."""
    agent, order = HeldTransfers({"h": "PROC"}), []
    try:
        try:
            raise TransferAbandoned("READ", 1, 0.5, ["h"], agent)
        except TransferAbandoned as exc:
            exc.when_ended(lambda: order.append("store: deregister"))
            raise
    except TransferAbandoned as exc:
        reaper.hold_abandoned(exc, lambda: order.append("reader: slots back"), label="r1")
    assert reaper.reap() == 0 and order == []
    agent.states["h"] = "DONE"
    assert reaper.reap() == 1 and order == ["store: deregister", "reader: slots back"]


def test_transfers_that_cannot_be_watched_are_never_freed(reaper):
    """Another process's transfers (a gateway's WRITEs) name no handle here, and without a probe nothing can say
    they ended."""
    freed = []
    reaper.hold_abandoned(TransferAbandoned("WRITE", 1, 0.5), lambda: freed.append(True), label="r1")
    assert reaper.reap() == 0 and reaper.held == 0 and not freed


def test_another_process_s_transfers_are_freed_once_its_probe_confirms_asked_at_doubling_intervals():
    """A gateway's WRITEs: the probe (its cancel sent again) is asked when due, first PROBE_FIRST_S after the
    hold, then at doubling intervals up to PROBE_MAX_S; a probe that raises confirms nothing."""
    now, asked, answers = [0.0], [], iter([False, RuntimeError("gateway unreachable"), False, True])

    def probe() -> bool:
        asked.append(now[0])
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    reaper = AbandonedTransfers(poll_s=3600.0, clock=lambda: now[0])
    try:
        exc, freed = TransferAbandoned("WRITE", 1, 0.5), []
        exc.probe = probe
        exc.when_ended(lambda: freed.append("store"))
        reaper.hold_abandoned(exc, lambda: freed.append("slots"), nbytes=100, label="r1")
        for now[0] in (0.0, 0.5, 1.0, 2.0, 3.0, 6.9, 7.0, 14.9, 15.0):
            reaper.reap()
        assert asked == [1.0, 3.0, 7.0, 15.0]  # due at 1, then 2, 4, 8 s after each answer
        assert freed == ["store", "slots"] and reaper.held == 0
        # The wait between probes stops growing at PROBE_MAX_S.
        never = TransferAbandoned("WRITE", 1, 0.5)
        never.probe = lambda: asked.append(now[0]) or False
        reaper.hold_abandoned(never, lambda: freed.append("never"), label="r2")
        asked.clear()
        for now[0] in range(16, 16 + 600):
            reaper.reap()
        gaps = [b - a for a, b in zip(asked, asked[1:])]
        assert max(gaps) == PROBE_MAX_S and gaps == sorted(gaps) and freed == ["store", "slots"]
        assert reaper.held == 1
    finally:
        reaper.close()


def test_the_reaper_thread_frees_on_its_own():
    agent, freed = HeldTransfers({"read": "DONE"}), threading.Event()
    reaper = AbandonedTransfers(poll_s=0.01)
    try:
        reaper.hold(agent, ["read"], freed.set, label="r1")
        assert freed.wait(60.0)  # the thread's round, no longer
    finally:
        reaper.close()
