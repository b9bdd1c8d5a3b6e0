"""NIXL plumbing without NIXL: descriptor rows, coalescing, polling waits, abandoned transfers, device ids."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from nixl_backends.nixl_io import TransferAbandoned, coalesce, descriptors, run_nixl_transfers, wait_until
from nixl_backends.obj_backend import obj_device_ids


def test_descriptors_broadcast_columns_into_uint64_rows():
    rows = descriptors(np.arange(3) * 10 + 7, 10, np.arange(3))
    assert rows.dtype == np.uint64
    assert rows.tolist() == [[7, 10, 0], [17, 10, 1], [27, 10, 2]]
    assert descriptors(4096, 64).tolist() == [[4096, 64, 0]]


def test_descriptors_flatten_a_grid_in_c_order():
    grid = np.array([[0, 100], [10, 110]])
    assert descriptors(grid, 5, 3).tolist() == [[0, 5, 3], [100, 5, 3], [10, 5, 3], [110, 5, 3]]


def test_descriptors_keep_addresses_above_2_to_the_53_exact():
    # Mixed uint64 and int64 columns would go through float64 and lose the low bits.
    high = np.array([(1 << 63) + 5], dtype=np.uint64)
    assert descriptors(high, 1).tolist() == [[(1 << 63) + 5, 1, 0]]


def test_coalesce_merges_adjacent_slices_of_equal_length():
    """The gateway's case: (chunk, layer) slices, adjacent on both sides except at a gap."""
    local = descriptors(np.array([0, 8, 16, 32]), 8)
    remote = descriptors(np.array([100, 108, 116, 124]), 8)
    merged_local, merged_remote = coalesce(local, remote)
    assert merged_local.tolist() == [[0, 24, 0], [32, 8, 0]]
    assert merged_remote.tolist() == [[100, 24, 0], [124, 8, 0]]


def test_coalesce_of_one_row_is_that_row():
    local, remote = descriptors(0, 8), descriptors(64, 8)
    assert coalesce(local, remote) == (local, remote)


def test_wait_until_returns_once_done():
    done = threading.Event()
    threading.Timer(0.02, done.set).start()
    assert wait_until(done.is_set, timeout_s=5.0)


def test_wait_until_gives_up_at_the_deadline():
    started = time.monotonic()
    assert not wait_until(lambda: False, timeout_s=0.02)
    assert 0.02 <= time.monotonic() - started < 1.0


class _NeverDoneAgent:
    """Stands in for a NIXL agent whose transfers never finish, which a real
    backend cannot be made to do on demand; records what the caller releases."""

    name = "never-done"

    def __init__(self) -> None:
        self.released: list[int] = []

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, agent_name):
        return len(self.released) + 1000

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "PROC"

    def release_xfer_handle(self, handle):
        self.released.append(handle)


def test_transfers_in_flight_at_the_deadline_are_abandoned_not_released():
    agent = _NeverDoneAgent()
    one = (descriptors(4096, 64), descriptors(0, 64, 1))
    with pytest.raises(TransferAbandoned, match="2 transfers still in flight"):
        run_nixl_transfers(agent, "READ", [one, one], "OBJ", timeout_s=0.01)
    # Releasing a handle NIXL still works on would free memory under it.
    assert agent.released == []


class _CountingAgent:
    """Transfers that finish on their second state check; records how many were in flight at once."""

    name = "counting"

    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.fail = fail
        self.in_flight: set[int] = set()
        self.most_in_flight = 0
        self.checks: dict[int, int] = {}
        self.posted: list[int] = []

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, agent_name):
        return int(local[0][0])  # the local address names the transfer

    def transfer(self, handle):
        self.posted.append(handle)
        self.in_flight.add(handle)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return "PROC"

    def check_xfer_state(self, handle):
        self.checks[handle] = self.checks.get(handle, 0) + 1
        if self.checks[handle] < 2:
            return "PROC"
        return "ERR" if handle in self.fail else "DONE"

    def release_xfer_handle(self, handle):
        self.in_flight.discard(handle)


@pytest.mark.parametrize("window", [1, 3, None])
def test_a_window_bounds_the_transfers_in_flight_and_keeps_every_result(window):
    agent = _CountingAgent(fail={4096 * 5})
    transfers = [(descriptors(4096 * i, 64), descriptors(0, 64, i)) for i in range(1, 11)]
    ok = run_nixl_transfers(agent, "READ", transfers, "OBJ", timeout_s=10.0, window=window)
    assert ok == [i != 5 for i in range(1, 11)]
    assert agent.posted == [4096 * i for i in range(1, 11)]  # in order, each once
    assert agent.most_in_flight == (window or 10) and not agent.in_flight


def test_transfer_abandoned_is_still_importable_from_the_store_module():
    from nixl_backends.store import TransferAbandoned as FromStore

    assert FromStore is TransferAbandoned


class _Agent:
    """Any object standing for a NIXL agent: ids are kept per agent object."""


def test_obj_device_ids_are_never_shared_on_one_agent():
    agent, other = _Agent(), _Agent()
    first = obj_device_ids(agent, 3)
    # Two stores on one agent draw from the same allocator, from any thread.
    drawn: list[range] = []
    threads = [threading.Thread(target=lambda: drawn.append(obj_device_ids(agent, 5))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ids = [i for r in [first, *drawn] for i in r]
    assert len(ids) == len(set(ids)) == 3 + 8 * 5
    assert min(ids) == 1
    # Another agent has its own ids.
    assert list(obj_device_ids(other, 2)) == [1, 2]


def test_a_completion_brings_the_poll_back_to_its_shortest_sleep(monkeypatch):
    """With a window of one, each transfer is posted by the poll that saw the one before it end: sleeps stay
    at their shortest while transfers keep ending; the control, a wait where nothing ends, backs off."""
    import nixl_backends.nixl_io as nixl_io

    sleeps: list[float] = []
    monkeypatch.setattr(nixl_io.time, "sleep", sleeps.append)
    transfers = [(descriptors(4096 * i, 64), descriptors(0, 64, i)) for i in range(1, 11)]
    assert run_nixl_transfers(_CountingAgent(), "READ", transfers, "OBJ", timeout_s=10.0, window=1) == [True] * 10
    assert len(sleeps) == 19 and max(sleeps) <= 2 * nixl_io._MIN_SLEEP_S

    sleeps.clear()
    one = (descriptors(4096, 64), descriptors(0, 64, 1))
    with pytest.raises(TransferAbandoned):
        run_nixl_transfers(_NeverDoneAgent(), "READ", [one], "OBJ", timeout_s=0.005)
    assert max(sleeps) == nixl_io._MAX_SLEEP_S
