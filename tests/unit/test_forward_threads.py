"""The OpenMP environment of the engines the harness starts: one thread count whether pinned or not."""

from __future__ import annotations

import pytest

from dualpath_dev.processes import forward_threads_env


@pytest.mark.parametrize("cores,ranks,threads,pinned_to", [
    ({0, 1}, 1, 1, "0"),  # the last core kept for transfer threads
    ({0, 1}, 2, 1, "0|0"),  # fewer compute cores than ranks: they share one
    ({0, 1, 2, 3, 4}, 2, 2, "0,1|2,3"),
    ({3}, 1, 1, "3"),  # one core: the forward computes there too
])  # fmt: skip
def test_pinned_or_not_a_rank_computes_with_as_many_threads(monkeypatch, cores, ranks, threads, pinned_to):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores)
    assert forward_threads_env(ranks, pinned=True) == {"VLLM_CPU_OMP_THREADS_BIND": pinned_to}
    # vLLM sizes a pinned rank's OpenMP pool by its core list; unpinned, OMP_NUM_THREADS says it.
    assert len(pinned_to.split("|")[0].split(",")) == threads
    assert forward_threads_env(ranks, pinned=False) == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "false"}
