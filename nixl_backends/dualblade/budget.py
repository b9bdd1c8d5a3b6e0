"""The budgeter: how many bytes of page cache this process may fill before the kernel must evict.

The page-cache path of the tier is only fast while the chunks it wrote are still
resident; past the budget, new writes evict older ones and reads go to the
device anyway. The budget therefore comes from what the kernel will actually let
this process keep (Dual-Blade eq. 1 and 2):

    M*   = min(M_avail, M_max - M_anon+shmem)        (1)
    B_pc = max(0, M* - reserved_bytes)               (2)

``M_avail`` is ``MemAvailable`` (the host's reclaimable headroom). Inside a
memory cgroup, page cache is charged to the cgroup, so its limit ``M_max`` less
the anonymous and shmem memory it already holds (which page cache cannot evict)
also binds. ``reserved_bytes`` is what the caller will pin (DMA buffers) on top.

cgroup layouts differ by host and container runtime (v1, v2, hybrid with v2 at
``unified/``, namespaced or not), so every cgroup file is optional: a missing or
unparsable one means "unknown" and is logged at debug level, never raised.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

# cgroup v1 writes "no limit" as a page-rounded number near 2**63, not a keyword.
_V1_UNLIMITED = 2**62


@dataclass(frozen=True)
class MemorySnapshot:
    version: Literal["v1", "v2", "none"]  # which cgroup hierarchy was read
    cgroup_path: str  # e.g. "/process_api/abc" ("" when none)
    limit_bytes: int | None  # None = unlimited / no cgroup
    anon_shmem_bytes: int  # anon + shmem charged to the cgroup (0 when none)
    # file-backed pages charged to the cgroup ("file" in v2, "total_cache"/"cache" in v1; 0 when none);
    # the kernel counts tmpfs/shmem pages here too
    page_cache_bytes: int
    available_bytes: int  # MemAvailable


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        logger.debug("cannot read %s: %s", path, e)
        return None


def _read_stat(path: str) -> dict[str, int]:
    """``key value`` lines (memory.stat); {} when missing or unparsable."""
    text = _read(path)
    if text is None:
        return {}
    try:
        return {key: int(value) for key, value in (line.split() for line in text.splitlines() if line.strip())}
    except ValueError:
        logger.debug("unparsable %s", path)
        return {}


def _limit(value: int | None) -> int | None:
    return None if value is None or value >= _V1_UNLIMITED else value


def _read_limit(path: str) -> int | None:
    """A memory limit in bytes; None when unlimited ("max" in v2, >= 2**62 in v1) or unknown."""
    text = _read(path)
    if text is None or text.strip() == "max":
        return None
    try:
        return _limit(int(text))
    except ValueError:
        logger.debug("unparsable %s", path)
        return None


def _smallest(limits: list[int | None]) -> int | None:
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def process_read_bytes(proc_root: str = "/proc") -> int | None:
    """Bytes this process (all its threads, NIXL's included) made the block layer read; None when unknown.

    The tier's page-cache hit ratio compares it with what its direct path read. The cgroup's own
    counters would include other processes, and v1's blkio ones stay at 0 without a throttle policy.
    """
    for line in (_read(os.path.join(proc_root, "self", "io")) or "").splitlines():
        name, _, value = line.partition(":")
        if name == "read_bytes":
            return int(value)
    return None


class MemoryBudgeter:
    def __init__(self, reserved_bytes: int = 0, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        if reserved_bytes < 0:
            raise ValueError(f"reserved_bytes must be >= 0, got {reserved_bytes}")
        self.reserved_bytes = reserved_bytes
        self._proc_root = proc_root
        self._cgroup_root = cgroup_root

    def page_cache_budget(self, snapshot: MemorySnapshot | None = None) -> int:
        """B_pc of eq. (1) and (2) for ``snapshot`` (a fresh one when None)."""
        s = snapshot if snapshot is not None else self.snapshot()
        m_star = s.available_bytes
        if s.limit_bytes is not None:
            m_star = min(m_star, s.limit_bytes - s.anon_shmem_bytes)
        return max(0, m_star - self.reserved_bytes)

    def snapshot(self) -> MemorySnapshot:
        available = self._mem_available()
        paths = self._cgroup_paths()
        # Hybrid hosts mount v1 memory at memory/ beside a cgroup2 at unified/; the v1 one is what charges us.
        v1_path = paths.get("memory")
        if v1_path is not None and os.path.isdir(self._join(self._cgroup_root, "memory", v1_path)):
            return self._snapshot_v1(v1_path, available)
        v2_path = paths.get("")
        if v2_path is not None:
            # Pure v2 mounts at the root; hybrid hosts at unified/ (where memory.max exists only if delegated).
            for mount in (self._cgroup_root, os.path.join(self._cgroup_root, "unified")):
                if os.path.isfile(self._join(mount, v2_path, "memory.max")):
                    return self._snapshot_v2(mount, v2_path, available)
        logger.debug("no memory cgroup found for this process; budgeting from MemAvailable alone")
        return MemorySnapshot("none", "", None, 0, 0, available)

    def _snapshot_v1(self, path: str, available: int) -> MemorySnapshot:
        directory = self._join(self._cgroup_root, "memory", path)
        stat = _read_stat(os.path.join(directory, "memory.stat"))
        # Own limit and, with use_hierarchy, the ancestors' folded into hierarchical_memory_limit.
        limit = _smallest([_read_limit(os.path.join(directory, "memory.limit_in_bytes")),
                           _limit(stat.get("hierarchical_memory_limit"))])
        # total_* include descendant cgroups, which share our limit.
        prefix = "total_" if "total_rss" in stat else ""
        return MemorySnapshot(
            version="v1", cgroup_path=path, limit_bytes=limit,
            anon_shmem_bytes=stat.get(prefix + "rss", 0) + stat.get(prefix + "shmem", 0),
            page_cache_bytes=stat.get(prefix + "cache", 0), available_bytes=available)

    def _snapshot_v2(self, mount: str, path: str, available: int) -> MemorySnapshot:
        directory = self._join(mount, path)
        # v2 has no hierarchical limit file: an ancestor's memory.max binds too, so take the smallest up to the mount.
        parts = [part for part in path.split("/") if part]
        limit = _smallest([_read_limit(os.path.join(mount, *parts[:depth], "memory.max"))
                           for depth in range(len(parts), -1, -1)])
        stat = _read_stat(os.path.join(directory, "memory.stat"))
        return MemorySnapshot(
            version="v2", cgroup_path=path, limit_bytes=limit,
            anon_shmem_bytes=stat.get("anon", 0) + stat.get("shmem", 0), page_cache_bytes=stat.get("file", 0),
            available_bytes=available)

    def _mem_available(self) -> int:
        path = os.path.join(self._proc_root, "meminfo")
        for line in (_read(path) or "").splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == "MemAvailable:":
                return int(fields[1]) * 1024  # meminfo's "kB" is KiB
        raise RuntimeError(f"no MemAvailable in {path}: cannot size the page-cache budget")

    def _cgroup_paths(self) -> dict[str, str]:
        """Controller -> cgroup path from /proc/self/cgroup; the v2 line (``0::/path``) is under ""."""
        paths: dict[str, str] = {}
        for line in (_read(os.path.join(self._proc_root, "self", "cgroup")) or "").splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                for controller in parts[1].split(","):
                    paths[controller] = parts[2]
        return paths

    @staticmethod
    def _join(root: str, *parts: str) -> str:
        # cgroup paths are absolute ("/a/b"); os.path.join would drop root for them.
        return os.path.join(root, *(part.lstrip("/") for part in parts))
