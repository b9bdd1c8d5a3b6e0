"""The emulated cluster's config: the cores the store server is pinned to (no network is built here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dualpath_dev.cluster import ClusterConfig, ClusterError, cpu_list


@pytest.mark.parametrize("text,cores", [("1", {1}), ("0,2-3", {0, 2, 3}), ("4-4", {4}),
                                        ("", None), ("a", None), ("1-", None), ("3-1", None), ("1,,2", None)])  # fmt: skip
def test_cpu_lists_read_as_taskset_reads_them(text, cores):
    assert cpu_list(text) == cores


def test_the_store_launcher_pins_what_it_starts_to_the_cores_named():
    core = max(os.sched_getaffinity(0))
    launcher = ClusterConfig(store_cpus=str(core)).validate().store_launcher
    printed = subprocess.run([*launcher, sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert printed.strip() == f"[{core}]"
    assert ClusterConfig().validate().store_launcher == []  # the control: unpinned, nothing prefixed


@pytest.mark.parametrize("cpus", ["x", "1-0", str(max(os.sched_getaffinity(0)) + 1)])
def test_store_cpus_outside_this_process_cores_are_refused_by_name(cpus):
    with pytest.raises(ClusterError, match=f"cluster.store_cpus must list cores of .* got '{cpus}'"):
        ClusterConfig(store_cpus=cpus).validate()
