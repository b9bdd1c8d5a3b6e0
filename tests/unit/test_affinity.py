"""kv_transfer_cores: the core a CPU worker leaves its transfer threads, and none when it reserves none."""

from __future__ import annotations

import pytest

from dualpath_connector.lanes import affinity


@pytest.fixture
def machine(monkeypatch):
    """A machine of NUMA nodes ``nodes`` whose worker is bound to ``computing`` (set by the test)."""
    from vllm.platforms import current_platform

    class Machine:
        nodes: list[list[int]] = [[0, 1, 2, 3]]
        computing: set[int] = {0, 1, 2, 3}

    monkeypatch.setattr(type(current_platform), "discover_numa_topology", lambda self: Machine.nodes, raising=False)
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda pid: set(Machine.computing))
    return Machine


def test_a_bound_forward_leaves_each_nodes_last_core_it_does_not_compute_on(machine):
    machine.nodes, machine.computing = [[0, 1, 2, 3], [4, 5, 6, 7]], {0, 1, 2, 4, 5, 6}
    assert affinity.kv_transfer_cores("cpu") == {3, 7}
    machine.computing = {0, 1, 2, 3, 4, 5, 6}  # bound over the whole of node 0: its last core all the same
    assert affinity.kv_transfer_cores("cpu") == {3, 7}


def test_an_unbound_forward_reserves_no_core(machine):
    """VLLM_CPU_OMP_THREADS_BIND=nobind: the worker may run anywhere, so pinning would only crowd every engine's
    transfer threads onto one core (the control: bound, the same machine gives a core)."""
    machine.nodes, machine.computing = [[0, 1]], {0, 1}
    assert affinity.kv_transfer_cores("cpu") is None
    machine.computing = {0}
    assert affinity.kv_transfer_cores("cpu") == {1}


def test_no_pinning_off_the_cpu_build():
    assert affinity.kv_transfer_cores("cuda") is None
