"""The Dual-Blade budgeter on fake /proc and /sys/fs/cgroup trees: cgroup v1, v2 and hybrid layouts,
the limit walk-up, eq. (1) and (2), tolerance of missing files; and one sanity run on this machine.

Numbers are distinct so that a wrong term (limit without shmem, avail instead of the limit, a child's
limit instead of its parent's) gives a different budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nixl_backends.dualblade.budget import MemoryBudgeter, MemorySnapshot, process_read_bytes

V1_UNLIMITED = "9223372036854771712"


def _meminfo(available_kb: int) -> str:
    return f"MemTotal:       99999999 kB\nMemFree:         1234567 kB\nMemAvailable:   {available_kb} kB\n"


def _budgeter(tmp_path: Path, files: dict[str, str], reserved: int = 0) -> MemoryBudgeter:
    """Writes ``files`` (paths under proc/ and cgroup/) and returns a budgeter rooted there."""
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return MemoryBudgeter(reserved, proc_root=str(tmp_path / "proc"), cgroup_root=str(tmp_path / "cgroup"))


def test_v1_with_limit(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(4_000_000),  # 4_096_000_000 bytes
        "proc/self/cgroup": "7:blkio:/\n4:memory:/process_api/abc\n1:cpu:/\n",
        "cgroup/memory/process_api/abc/memory.limit_in_bytes": "3000000000\n",
        # per-cgroup rss/shmem/cache differ from total_* so the wrong keys show
        "cgroup/memory/process_api/abc/memory.stat": (
            f"cache 7\nrss 1\nshmem 2\nhierarchical_memory_limit {V1_UNLIMITED}\n"
            "total_cache 900000000\ntotal_rss 500000000\ntotal_shmem 200000000\n"),
    }, reserved=100_000_000)
    s = b.snapshot()
    assert s == MemorySnapshot("v1", "/process_api/abc", 3_000_000_000, 700_000_000, 900_000_000,
                               4_096_000_000)
    # min(4_096_000_000, 3_000_000_000 - 700_000_000) - 100_000_000
    assert b.page_cache_budget(s) == 2_200_000_000
    assert b.page_cache_budget() == 2_200_000_000


def test_v1_unlimited(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(2_000_000),  # 2_048_000_000 bytes
        "proc/self/cgroup": "4:memory:/x\n",
        "cgroup/memory/x/memory.limit_in_bytes": V1_UNLIMITED,
        "cgroup/memory/x/memory.stat": (
            f"hierarchical_memory_limit {V1_UNLIMITED}\ntotal_rss 300000000\ntotal_shmem 5\ntotal_cache 6\n"),
    }, reserved=48_000_000)
    s = b.snapshot()
    assert s.limit_bytes is None
    assert s.anon_shmem_bytes == 300_000_005
    assert b.page_cache_budget(s) == 2_000_000_000


def test_v1_hierarchical_limit_smaller(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(8_000_000),
        "proc/self/cgroup": "4:memory,foo:/p/c\n",
        "cgroup/memory/p/c/memory.limit_in_bytes": "5000000000",
        # no total_* keys: falls back to the cgroup's own counters
        "cgroup/memory/p/c/memory.stat": (
            "cache 250000000\nrss 300000000\nshmem 100000000\nhierarchical_memory_limit 1500000000\n"),
    }, reserved=20_000_000)
    s = b.snapshot()
    assert (s.limit_bytes, s.anon_shmem_bytes, s.page_cache_bytes) == (1_500_000_000, 400_000_000, 250_000_000)
    assert b.page_cache_budget(s) == 1_080_000_000


def test_v2_limit_on_parent_only(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(3_000_000),  # 3_072_000_000 bytes
        "proc/self/cgroup": "0::/a/b\n",
        "cgroup/a/memory.max": "2000000000\n",
        "cgroup/a/b/memory.max": "max\n",
        "cgroup/a/b/memory.stat": "anon 600000000\nfile 333000000\nkernel 17\nshmem 150000000\n",
        "cgroup/a/memory.stat": "anon 1\nfile 2\nshmem 3\n",
    }, reserved=50_000_000)
    s = b.snapshot()
    assert s == MemorySnapshot("v2", "/a/b", 2_000_000_000, 750_000_000, 333_000_000, 3_072_000_000)
    # min(3_072_000_000, 2_000_000_000 - 750_000_000) - 50_000_000
    assert b.page_cache_budget(s) == 1_200_000_000


def test_v2_smallest_limit_up_the_tree(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(9_000_000),
        "proc/self/cgroup": "0::/a/b/c\n",
        "cgroup/memory.max": "max",
        "cgroup/a/memory.max": "4000000000",
        "cgroup/a/b/memory.max": "2500000000",
        "cgroup/a/b/c/memory.max": "max",
        "cgroup/a/b/c/memory.stat": "anon 100000000\nshmem 0\nfile 0\n",
    })
    s = b.snapshot()
    assert s.limit_bytes == 2_500_000_000
    assert b.page_cache_budget(s) == 2_400_000_000


def test_v2_max_is_unlimited(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(1_000_000),  # 1_024_000_000 bytes
        "proc/self/cgroup": "0::/svc\n",
        "cgroup/svc/memory.max": "max\n",
        "cgroup/svc/memory.stat": "anon 900000000\nshmem 90000000\nfile 70000000\n",
    }, reserved=24_000_000)
    s = b.snapshot()
    assert (s.version, s.limit_bytes) == ("v2", None)
    # anon+shmem counts only against a limit; with none, MemAvailable alone bounds it
    assert b.page_cache_budget(s) == 1_000_000_000


def test_hybrid_prefers_v1_memory(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(6_000_000),
        "proc/self/cgroup": "9:name=systemd:/\n7:blkio:/\n4:memory:/process_api/76bad\n0::/process_api/76bad\n",
        "cgroup/memory/process_api/76bad/memory.limit_in_bytes": "1700000000",
        "cgroup/memory/process_api/76bad/memory.stat": "total_rss 200000000\ntotal_shmem 0\ntotal_cache 42\n",
        "cgroup/unified/process_api/76bad/memory.max": "999",
        "cgroup/unified/process_api/76bad/memory.stat": "anon 5\nshmem 5\nfile 5\n",
    })
    s = b.snapshot()
    assert s == MemorySnapshot("v1", "/process_api/76bad", 1_700_000_000, 200_000_000, 42, 6_144_000_000)
    assert b.page_cache_budget(s) == 1_500_000_000


def test_hybrid_falls_back_to_unified_when_v1_dir_absent(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(6_000_000),
        "proc/self/cgroup": "4:memory:/gone\n0::/svc\n",
        "cgroup/unified/svc/memory.max": "1300000000",
        "cgroup/unified/svc/memory.stat": "anon 100000000\nshmem 11000000\nfile 3\n",
    })
    s = b.snapshot()
    assert s == MemorySnapshot("v2", "/svc", 1_300_000_000, 111_000_000, 3, 6_144_000_000)
    assert b.page_cache_budget(s) == 1_189_000_000


def test_no_cgroup(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {"proc/meminfo": _meminfo(500_000)}, reserved=12_000_000)  # no proc/self/cgroup
    s = b.snapshot()
    assert s == MemorySnapshot("none", "", None, 0, 0, 512_000_000)
    assert b.page_cache_budget(s) == 500_000_000


def test_cgroup_listed_but_not_mounted_is_none(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {"proc/meminfo": _meminfo(500_000), "proc/self/cgroup": "4:memory:/x\n0::/x\n"})
    assert b.snapshot().version == "none"


def test_reserved_beyond_available_gives_zero(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {"proc/meminfo": _meminfo(1_000)}, reserved=1_024_001)
    assert b.page_cache_budget() == 0


def test_anon_beyond_limit_gives_zero() -> None:
    s = MemorySnapshot("v2", "/a", 1_000, 1_500, 0, 10_000)
    # and the given snapshot is used: these roots hold nothing to read
    b = MemoryBudgeter(0, proc_root="/nonexistent/proc", cgroup_root="/nonexistent/cgroup")
    assert b.page_cache_budget(s) == 0
    assert b.page_cache_budget(MemorySnapshot("v2", "/a", 3_000, 1_500, 0, 10_000)) == 1_500


def test_missing_stat_files_tolerated(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(2_000_000),
        "proc/self/cgroup": "7:blkio:/io\n4:memory:/m\n",
        "cgroup/memory/m/memory.limit_in_bytes": "1000000000",
        # no memory.stat
    }, reserved=1_000)
    s = b.snapshot()
    assert s == MemorySnapshot("v1", "/m", 1_000_000_000, 0, 0, 2_048_000_000)
    assert b.page_cache_budget(s) == 999_999_000


def test_unparsable_files_tolerated(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {
        "proc/meminfo": _meminfo(2_000_000),
        "proc/self/cgroup": "garbage line\n0::/s\n",
        "cgroup/s/memory.max": "lots\n",
        "cgroup/s/memory.stat": "anon many\n",
    })
    assert b.snapshot() == MemorySnapshot("v2", "/s", None, 0, 0, 2_048_000_000)


def test_process_read_bytes(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "io").write_text("rchar: 900\nwchar: 5\nread_bytes: 12288\nwrite_bytes: 4096\n")
    assert process_read_bytes(str(tmp_path)) == 12_288
    assert process_read_bytes(str(tmp_path / "none")) is None
    assert isinstance(process_read_bytes(), int)  # this machine


def test_missing_mem_available_raises(tmp_path: Path) -> None:
    b = _budgeter(tmp_path, {"proc/meminfo": "MemTotal: 1000 kB\nMemFree: 10 kB\n"})
    with pytest.raises(RuntimeError, match="MemAvailable"):
        b.snapshot()


def test_negative_reserved_rejected() -> None:
    with pytest.raises(ValueError):
        MemoryBudgeter(-1)


def test_this_machine() -> None:
    b = MemoryBudgeter()
    s = b.snapshot()
    assert s.version in ("v1", "v2", "none")
    assert isinstance(s.cgroup_path, str)
    assert s.limit_bytes is None or (isinstance(s.limit_bytes, int) and s.limit_bytes > 0)
    for value in (s.anon_shmem_bytes, s.page_cache_bytes, s.available_bytes):
        assert isinstance(value, int) and value >= 0
    assert s.available_bytes > 0
    budget = b.page_cache_budget(s)
    assert isinstance(budget, int) and 0 <= budget <= s.available_bytes
