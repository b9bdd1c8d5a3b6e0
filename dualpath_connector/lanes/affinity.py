"""Where the connector's own threads run on vLLM's CPU build."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def kv_transfer_cores(device_type: str) -> set[int] | None:
    """Cores for the connector's own threads on vLLM's CPU build; None elsewhere.

    A CPU worker binds itself to the cores its OpenMP threads compute on;
    threads we start inherit that binding, so a side channel or a NIXL job
    would queue behind the forward (and a peer engine's worker bound to the
    same core) for seconds. vLLM keeps the last core of each NUMA node for KV
    transfer threads (NixlConnector pins its own there); so do we, unless the
    forward was bound there (``VLLM_CPU_OMP_THREADS_BIND`` naming it): then the
    node's last core it does not compute on. Called once the worker is bound.
    A worker that is not bound (``VLLM_CPU_OMP_THREADS_BIND=nobind``: its
    forward threads go wherever the kernel puts them) reserves no core, and
    pinning our threads would only take their freedom: every engine on the
    machine would crowd them onto the same last core. None then.
    """
    if device_type != "cpu":
        return None
    from vllm.platforms import current_platform

    computing = os.sched_getaffinity(0)
    nodes = [set(node) for node in current_platform.discover_numa_topology() if node]
    if all(node <= computing for node in nodes):
        return None
    cores = {max(node - computing or node) for node in nodes}
    return cores or None


def pin_current_thread(cores: set[int] | None) -> None:
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:  # a container's cpuset may not include that core
            logger.warning("could not pin %s to cores %s: %s", threading.current_thread().name, sorted(cores), exc)


@contextmanager
def threads_started_on(cores: set[int] | None) -> Iterator[None]:
    """Threads that native libraries start inside this block (NIXL's UCX and
    OBJ backends, the AWS SDK's executor) run on ``cores``, not beside the forward."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_current_thread(cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
