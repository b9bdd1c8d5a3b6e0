"""Child processes for tests, demos and benchmarks: free ports, process groups, health-checked services.

Everything started here runs in its own process group and is stopped by the
PID held here (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

_WARNING = re.compile(r"(^|\s)(WARNING|ERROR) ")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now, the first of ``count`` in a row (a TP engine's side
    channels: one per rank at port + rank).

    Drawn below the kernel's ephemeral range, never from it (not by binding to port 0): the kernel hands
    out ports from that range to every process that binds to port 0 or connects (vLLM's own sockets, UCX's
    listeners, other tests' clients), so a port found free there can be taken before its user binds it
    (CI saw a side channel's ``Address already in use`` so). Below the range only another explicit choice
    can take it, and those are drawn at random from some 20,000 ports.
    """
    low = _ephemeral_range_start()
    rng = random.SystemRandom()
    for _ in range(200):
        first = rng.randrange(10_000, low - count)
        if all(_port_is_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} free TCP ports in a row below {low} on 127.0.0.1")


def _ephemeral_range_start() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return max(low, 20_000)


def omp_threads_bind(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` pinning a CPU engine of ``ranks`` TP workers: this process's cores but the
    last split among them (ranks share cores when there are fewer than ranks).

    Unless told which cores, vLLM's CPU workers each bind to a NUMA node: on a
    one-node machine the second refuses to start ("Not enough allowed NUMA
    nodes to bind threads of 2 local CPUWorkers"). The last core stays free,
    as ``VLLM_CPU_NUM_OF_RESERVED_CPU`` keeps it for one-rank engines: the
    connector's transfer threads, its side channel and the store run there,
    not behind a forward (:func:`dualpath_connector.lanes.affinity.kv_transfer_cores`).
    """
    return "|".join(",".join(map(str, group)) for group in _compute_cores(ranks))


def _compute_cores(ranks: int) -> list[list[int]]:
    """Each rank's cores: this process's cores but the last, split among the ranks (shared when too few)."""
    cores = sorted(os.sched_getaffinity(0))
    compute = cores[:-1] or cores
    per_rank = len(compute) // ranks
    return [compute[i * per_rank : (i + 1) * per_rank] if per_rank else [compute[i % len(compute)]] for i in range(ranks)]


def forward_threads_env(ranks: int, pinned: bool) -> dict[str, str]:
    """The OpenMP environment of a CPU engine of ``ranks`` TP workers: as many forward threads per rank as
    :func:`omp_threads_bind` gives it cores, pinned there or (``pinned`` False) left to the kernel.

    Every engine the harness starts computes with this thread count: it sets the bf16 rounding of the
    GEMMs, so engines compared bit for bit must agree on it (vLLM's own choice differs between one-rank and
    TP engines, and on SMT machines); the cores they run on do not change a result. Pinned, every engine
    of the machine computes on the same cores: right for a benchmark that keeps compute off the transfer
    core, but where several engines run at once (the test suite's two workers) their forwards queue on
    one core while the other idles (``make test`` used 108% of 200%).
    """
    if pinned:
        return {"VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(ranks)}
    threads = len(_compute_cores(ranks)[0])
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "false"}


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class ServiceProcess:
    """A service in its own process group, logging to a file, ready when ``health_url`` answers 200.

    Subclasses set ``args``, ``env``, ``log_path`` and ``health_url``; ``stop``
    ends the whole group by the PID held here.
    """

    args: list[str]
    env: dict[str, str] | None = None
    log_path: Path
    health_url: str
    # The CA file an https health_url is checked against.
    health_ca: str | None = None
    stop_grace_s = 20.0
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> ServiceProcess:
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=self.health_ca) if self.health_ca else None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.args[:3]} exited during start-up; see {self.log_path}"
                                       f"{self._log_tail()}")
                try:
                    if urllib.request.urlopen(self.health_url, timeout=5, context=context).status == 200:
                        return self
                except OSError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not healthy after {timeout_s}s; see {self.log_path}{self._log_tail()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def _log_tail(self, lines: int = 30) -> str:
        """The log's last lines, for an error raised where the log itself will be gone (a CI machine's)."""
        try:
            tail = Path(self.log_path).read_bytes()[-16384:].decode(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f" (log unreadable: {exc})"
        return "; its last lines:\n" + "\n".join(tail)

    def warning_lines(self, limit: int = 20) -> str:
        """The log's last ``limit`` warnings and errors, for a failed comparison's message (CI keeps no logs)."""
        try:
            lines = Path(self.log_path).read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        # vLLM's lines carry a "(Worker_TP0 pid=...) " prefix before the level; ours may start with it.
        found = [line for line in lines if _WARNING.search(line)]
        return "\n".join(found[-limit:]) or "(none)"

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s=self.stop_grace_s)
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_all(services: Sequence[ServiceProcess]) -> None:
    """Start services side by side, each ready when this returns; stop them all if one fails.

    A vLLM engine's start-up is mostly single-threaded imports in three
    processes one after the other, so engines started together overlap.
    """
    errors: list[BaseException] = []

    def start(service: ServiceProcess) -> None:
        try:
            service.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in services]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for service in services:
            service.stop()
        raise errors[0]
