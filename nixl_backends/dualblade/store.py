"""The Dual-Blade store: chunks in extents of one preallocated file, each split between two I/O paths.

Every chunk object (Full Block and trailer) has one 4 KiB-aligned extent
(:mod:`~nixl_backends.dualblade.bind_map`). Its first ``n1`` Layer Blocks go
through the page cache (a buffered descriptor), the rest through ``O_DIRECT``
(:mod:`~nixl_backends.dualblade.extents`), both moved by NIXL's POSIX
backend. ``n1`` comes from Algorithm 1 over the page-cache budget the
budgeter measures in this process's memory cgroup, spread over every extent
the tier has and re-planned as the budget moves (:mod:`~nixl_backends.dualblade.planner`).
So under memory pressure the page cache holds only what fits, and the rest is
read straight from the device instead of thrashing the cache.

A read verifies the whole object against the checksum its bind recorded; a
mismatch is a miss and frees the extent. Writes allocate extents (evicting
the ranker's coldest chunks when the tier is full), write, ``fdatasync``, and
only then bind. One process writes a tier (a lock file); any number may look
chunks up (they follow the journal).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from nixl_backends.configuration import ConfigError
from nixl_backends.dualblade.bind_map import BindMap, Binding
from nixl_backends.dualblade.budget import MemoryBudgeter, process_read_bytes
from nixl_backends.dualblade.config import DualBladeStoreConfig
from nixl_backends.buffers import ALIGNMENT, align_down, align_up
from nixl_backends.dualblade.extents import ExtentFile
from nixl_backends.dualblade.pipeline import AdaptivePipeline, Strategy
from nixl_backends.dualblade.planner import ResidencyPlan, plan_ranked, plan_residency
from nixl_backends.dualblade.ranker import RANKERS, Ranker
from nixl_backends.layout import BlockLayout
from nixl_backends.nixl_io import TransferAbandoned, descriptors, run_nixl_transfers
from nixl_backends.posix import create_posix_backend
from nixl_backends.store import KVStore, StoreMetrics

logger = logging.getLogger(__name__)

JOURNAL, EXTENTS, LOCK = "bindmap.journal", "extents.dat", "writer.lock"
COUNTERS = (
    "local_tier_hit_chunks", "local_tier_miss_chunks", "local_tier_corrupt_chunks", "local_tier_evicted_chunks",
    "local_tier_page_cache_bytes_read", "local_tier_direct_bytes_read",
    "local_tier_page_cache_bytes_written", "local_tier_direct_bytes_written",
)  # fmt: skip


def object_checksum(addr: int, nbytes: int) -> int:
    """xxh3-64 of ``nbytes`` of memory at ``addr`` (native; no copy)."""
    return xxhash.xxh3_64_intdigest((ctypes.c_char * nbytes).from_address(addr))


class DualBladeStore(KVStore):
    def __init__(self, config: DualBladeStoreConfig, layout: BlockLayout, agent: Any = None) -> None:
        super().__init__(layout)
        self.config = config
        self.root = os.path.abspath(config.root)
        os.makedirs(self.root, exist_ok=True)
        self.extent_bytes = align_up(layout.object_bytes)
        num_extents = config.capacity_bytes // self.extent_bytes
        if num_extents == 0:
            raise ConfigError(f"store.capacity_bytes ({config.capacity_bytes}) is smaller than one chunk "
                              f"({self.extent_bytes} bytes with its alignment)")
        self._agent = agent
        self._lock = threading.Lock()  # the bind map, pins, ranker and plan
        # Counters and gauges under their own lock: the engine's stats call never waits on a journal fsync.
        self._stats_lock = threading.Lock()
        self._counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._gauges: dict[str, float] = {}
        journal = os.path.join(self.root, JOURNAL)
        if agent is None:
            self._map = BindMap(journal, num_extents, writer=False)
            return
        with contextlib.ExitStack() as undo:  # a failed start-up leaves no fd, lock or registration behind
            self._lock_fd = self._take_writer_lock()
            undo.callback(os.close, self._lock_fd)
            self._extents = ExtentFile(config.device or os.path.join(self.root, EXTENTS), num_extents * self.extent_bytes,
                                       device=bool(config.device))
            undo.callback(self._extents.close)
            if self._extents.capacity < self.extent_bytes:
                raise ConfigError(f"store.device {config.device} holds less than one chunk ({self.extent_bytes} bytes)")
            self._map = BindMap(journal, self._extents.capacity // self.extent_bytes, writer=True)
            undo.callback(self._map.close)
            create_posix_backend(agent, config.io_engine)
            fds = [fd for fd in (self._extents.buffered_fd, self._extents.direct_fd) if fd is not None]
            self._registration = agent.register_memory([(0, self._extents.capacity, fd, "") for fd in fds], "FILE")
            undo.callback(agent.deregister_memory, self._registration)
            self._init_writer(config)
            undo.pop_all()
        logger.info("dualblade tier at %s: %d extents of %d bytes (%s), direct path %s",
                    self.root, self._map.num_extents, self.extent_bytes, self._extents.path,
                    "on" if self._extents.direct_fd is not None else "off")

    def _init_writer(self, config: DualBladeStoreConfig) -> None:
        self._ranker: Ranker = RANKERS[config.ranker]()
        for key in self._map.bindings:  # journal order: oldest bind first
            self._ranker.touch(key)
        # Extents of reads in flight: eviction skips them, and a free waits for the read to end.
        self._pins: Counter[int] = Counter()
        self._free_when_unpinned: set[int] = set()
        self._budgeter = MemoryBudgeter(config.reserve_bytes)
        self._pipeline = AdaptivePipeline(config.pipeline)
        self._plan = ResidencyPlan(0, 0)
        self._planned_at = -math.inf
        self._last_read_bytes: tuple[int | None, int, int] = (None, 0, 0)
        self._splits: dict[tuple[int, bool], tuple[list[tuple[int, int]], tuple[int, int] | None]] = {}
        self.replan()

    def _take_writer_lock(self) -> int:
        fd = os.open(os.path.join(self.root, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"dualblade tier {self.root} is written by another process; give each engine "
                               f"worker its own store.root") from None
        return fd

    # -- planning ------------------------------------------------------------------------------

    @property
    def plan(self) -> ResidencyPlan:
        return self._plan

    def replan(self) -> ResidencyPlan:
        """Re-read the budget and re-run Algorithm 1; layers that left the page-cache path are dropped from it."""
        budget = int(self._budgeter.page_cache_budget() * (1 - self.config.page_cache_headroom))
        knob = budget if self.config.page_cache_bytes is None else min(self.config.page_cache_bytes, budget)
        S, L = self.layout.layer_block_bytes, self.layout.num_layers
        with self._lock:
            old = self._plan
            if self.config.residency == "ranked":
                new = plan_ranked(knob, S, L, self._ranker.hottest_first())
            else:
                # Planned over every extent, not just the resident chunks: the page-cache share then stays
                # within X however many chunks the next saves add before the next plan.
                new = plan_residency(knob, S, L, self._map.num_extents, self._ranker.hottest_first())
            if new.page_cache_layers < old.page_cache_layers:
                demoted = list(self._map.bindings)
            else:
                demoted = [k for k in old.boosted - new.boosted if k in self._map.bindings]
            for key in demoted:
                start, end = (align_down(n * S) for n in (new.layers_for(key), old.layers_for(key)))
                if end > start:
                    self._extents.drop_cached(self._map.bindings[key].extent * self.extent_bytes + start, end - start)
            if new.page_cache_layers != old.page_cache_layers:
                self._pipeline.retry()
            self._plan = new
            self._planned_at = time.monotonic()
            resident = len(self._map.bindings)
        with self._stats_lock:
            self._gauges.update(
                local_tier_page_cache_budget_bytes=budget,
                local_tier_page_cache_layers=new.page_cache_layers,
                local_tier_used_bytes=resident * self.extent_bytes,
                local_tier_capacity_bytes=self._extents.capacity,
            )
            self._update_hit_ratio(process_read_bytes())
        return new

    def _update_hit_ratio(self, read_bytes: int | None) -> None:
        # This process's device reads since the last plan, less what the direct path read, were page-cache misses.
        page_cache = self._counters["local_tier_page_cache_bytes_read"]
        direct = self._counters["local_tier_direct_bytes_read"]
        last_read, last_pc, last_direct = self._last_read_bytes
        self._last_read_bytes = (read_bytes, page_cache, direct)
        if read_bytes is None or last_read is None or page_cache == last_pc:
            return
        missed = max(0, (read_bytes - last_read) - (direct - last_direct))
        self._gauges["local_tier_page_cache_hit_ratio"] = round(max(0.0, 1.0 - missed / (page_cache - last_pc)), 4)

    def _maybe_replan(self) -> None:
        if time.monotonic() - self._planned_at >= self.config.replan_interval_s:
            self.replan()

    def _split(self, page_cache_layers: int, aligned: bool) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
        """(page-cache ranges, direct range) of one object, as (offset, length) within it.

        The direct range is the 4 KiB-aligned middle from the first direct
        layer; what is left (the front layers, the unaligned end with the
        trailer) takes the page cache. Memory that is not 4 KiB-aligned
        cannot go direct at all.
        """
        cached = self._splits.get((page_cache_layers, aligned))
        if cached is not None:
            return cached
        size = self.layout.object_bytes
        start, end = align_down(page_cache_layers * self.layout.layer_block_bytes), align_down(size)
        if not aligned or self._extents.direct_fd is None or page_cache_layers >= self.layout.num_layers or end <= start:
            split: tuple[list[tuple[int, int]], tuple[int, int] | None] = ([(0, size)], None)
        else:
            split = ([(0, start)] if start else []) + ([(end, size - end)] if end < size else []), (start, end - start)
        self._splits[(page_cache_layers, aligned)] = split
        return split

    # -- I/O -----------------------------------------------------------------------------------

    def _require_agent(self) -> None:
        if self._agent is None:
            raise RuntimeError("DualBladeStore was opened without a NIXL agent: lookup only")

    def _transfer(self, op: str, chunks: list[tuple[int, int, int]]) -> list[bool]:
        """Move ``(addr, extent, page_cache_layers)`` chunks; one flag per chunk."""
        # Per chunk: its page-cache request and its direct request (either may be absent).
        requests: list[list[tuple[str, int, tuple[np.ndarray, np.ndarray]]]] = []
        for addr, extent, layers in chunks:
            ranges, middle = self._split(layers, addr % ALIGNMENT == 0)
            base = extent * self.extent_bytes
            own = []
            if ranges:
                offsets = np.array([o for o, _ in ranges], dtype=np.uint64)
                lengths = np.array([n for _, n in ranges], dtype=np.uint64)
                own.append(("page_cache", int(lengths.sum()), (
                    descriptors(addr + offsets, lengths), descriptors(base + offsets, lengths, self._extents.buffered_fd))))
            if middle is not None:
                own.append(("direct", middle[1], (
                    descriptors(addr + middle[0], middle[1]),
                    descriptors(base + middle[0], middle[1], self._extents.direct_fd))))
            requests.append(own)
        flat = [(i, *request) for i, own in enumerate(requests) for request in own]
        both = len(chunks) > 1 and any(path == "direct" for _, path, _, _ in flat)
        strategy: Strategy = self._pipeline.next_strategy() if op == "READ" and both else "intra"
        if strategy == "cross":  # every direct read first, then the page-cache copies
            flat.sort(key=lambda request: request[1] != "direct")
        started = time.perf_counter()
        results = run_nixl_transfers(self._agent, op, [pair for *_, pair in flat], "FILE", self.config.io_timeout_s)
        if op == "READ" and both:
            with self._lock:  # reads run on several threads at once (store_reads_in_flight)
                self._pipeline.record(strategy, sum(n for _, _, n, _ in flat), time.perf_counter() - started)
        ok = [True] * len(chunks)
        for (i, *_), result in zip(flat, results):
            ok[i] = ok[i] and result
        moved: Counter[str] = Counter()
        for i, path, nbytes, _ in flat:
            if ok[i]:
                moved[f"local_tier_{path}_bytes_{'read' if op == 'READ' else 'written'}"] += nbytes
        with self._stats_lock:
            self._counters.update(moved)
        return ok

    def lookup(self, keys: Sequence[str]) -> int:
        with self._lock:
            if self._agent is None:
                self._map.refresh()
            bindings = self._map.bindings
            for count, key in enumerate(keys):
                if key not in bindings:
                    return count
            return len(keys)

    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        self._require_agent()
        self._maybe_replan()
        size = self.layout.object_bytes
        with self._lock:
            found = [(i, self._map.bindings[key]) for i, key in enumerate(keys) if key in self._map.bindings]
            for _, binding in found:
                self._pins[binding.extent] += 1
            chunks = [(dst_addrs[i], b.extent, self._plan.layers_for(keys[i])) for i, b in found]
        try:
            moved = self._transfer("READ", chunks)
        except TransferAbandoned as exc:
            # NIXL may still read these extents: they stay pinned until its transfers ended.
            exc.when_ended(lambda: self._unpin([b.extent for _, b in found]))
            raise
        except BaseException:
            self._unpin([b.extent for _, b in found])
            raise
        ok = [False] * len(keys)
        corrupt: list[tuple[str, Binding]] = []
        for (i, binding), good in zip(found, moved):
            if good and object_checksum(dst_addrs[i], size) == binding.checksum:
                ok[i] = True
            elif good:
                corrupt.append((keys[i], binding))
        self._unpin([b.extent for _, b in found])
        with self._lock:
            for (i, binding) in found:
                # Not a key deleted while this read held its extent: it left the ranker then.
                if ok[i] and self._map.bindings.get(keys[i]) == binding:
                    self._ranker.touch(keys[i])
            if corrupt:
                logger.warning("dualblade: %d chunk(s) changed on disk since written (first %s); dropped",
                               len(corrupt), corrupt[0][0])
                # Only if still bound to what was read: a save may have stored the chunk again meanwhile.
                self._unbind([key for key, b in corrupt if self._map.bindings.get(key) == b], trim=True)
        with self._stats_lock:
            self._counters.update(local_tier_hit_chunks=sum(ok), local_tier_miss_chunks=len(keys) - sum(ok),
                                  local_tier_corrupt_chunks=len(corrupt))
        return ok

    def _release_extents(self, extents: list[int]) -> None:
        """Extents a failed write allocated, free again."""
        with self._lock:
            self._map.release(extents)

    def _unpin(self, extents: list[int]) -> None:
        with self._lock:
            self._pins.subtract(extents)
            for extent in extents:
                if self._pins[extent] <= 0:
                    del self._pins[extent]
                    if extent in self._free_when_unpinned:
                        self._free_when_unpinned.discard(extent)
                        self._free([extent])

    def _unbind(self, keys: list[str], trim: bool) -> list[int]:
        """Journal the frees (lock held); returns the unpinned extents, trimmed and free unless ``trim`` is False."""
        extents = self._map.unbind(keys)
        for key in keys:
            self._ranker.remove(key)
        reusable = [e for e in extents if e not in self._pins]
        self._free_when_unpinned.update(e for e in extents if e in self._pins)
        if trim:
            self._free(reusable)
        return reusable

    def _free(self, extents: list[int]) -> None:
        """TRIM and return to the free list (lock held)."""
        for extent in extents:
            self._extents.discard(extent * self.extent_bytes, self.extent_bytes)
        self._map.release(extents)

    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        self._require_agent()
        self._maybe_replan()
        done = [False] * len(keys)
        todo: dict[str, int] = {}  # key -> index of its first occurrence
        with self._lock:
            for i, key in enumerate(keys):
                if key in self._map.bindings:
                    done[i] = True  # content-addressed: already stored
                else:
                    todo.setdefault(key, i)
            extents = self._map.allocate(len(todo))
            if len(extents) < len(todo):
                extents += self._evict(len(todo) - len(extents), set(keys))
            # Without room (every resident chunk pinned by reads) the last chunks are not stored here.
            writing = list(zip(todo.items(), extents))
            chunks = [(src_addrs[i], extent, self._plan.layers_for(key)) for (key, i), extent in writing]
        checksums = [object_checksum(addr, self.layout.object_bytes) for addr, _, _ in chunks]
        try:
            written = self._transfer("WRITE", chunks)
            if any(written):
                self._extents.sync()  # durable before a bind can name it
        except TransferAbandoned as exc:
            exc.when_ended(lambda: self._release_extents(extents))  # NIXL may still write them until then
            raise
        except BaseException:
            self._release_extents(extents)
            raise
        with self._lock:
            # Another thread (a save beside a fill) may have stored the same chunk meanwhile: keep its copy.
            bound = [(key, Binding(extent, checksum))
                     for ((key, _), extent), checksum, good in zip(writing, checksums, written)
                     if good and key not in self._map.bindings]
            self._map.bind(bound)
            for key, _ in bound:
                self._ranker.touch(key)
            kept = {binding.extent for _, binding in bound}
            self._free([extent for _, extent in writing if extent not in kept])
        stored = {key for ((key, _), _), good in zip(writing, written) if good}
        for (key, _), _ in writing:
            if key not in stored:
                logger.warning("dualblade: write of %s failed", key)
        return [d or key in stored for d, key in zip(done, keys)]

    def _evict(self, count: int, keep: set[str]) -> list[int]:
        """Free up to ``count`` extents for reuse by unbinding the ranker's coldest chunks (lock held)."""
        skip = set(keep)
        if self._pins:
            skip.update(k for k, b in self._map.bindings.items() if b.extent in self._pins)
        victims: list[str] = []
        while len(victims) < count:
            victim = self._ranker.coldest(skip)
            if victim is None:
                break
            victims.append(victim)
            skip.add(victim)
        with self._stats_lock:
            self._counters["local_tier_evicted_chunks"] += len(victims)
        # Reused at once by this write: no TRIM (it would only make the file system allocate again).
        # Lowest first, as allocate() hands them out: the write stays as sequential as the free extents allow.
        return sorted(self._unbind(victims, trim=False))

    def delete(self, keys: Sequence[str]) -> None:
        # Unlike a POSIX or S3 store, only the writer (the process with the agent) can free: it owns the journal.
        self._require_agent()
        with self._lock:
            self._unbind(list(keys), trim=True)

    def metrics(self) -> StoreMetrics:
        with self._stats_lock:
            return StoreMetrics(dict(self._counters), dict(self._gauges))

    def close(self) -> None:
        if self._agent is None:
            return
        with contextlib.suppress(Exception):
            self._agent.deregister_memory(self._registration)
        self._map.close()
        self._extents.close()
        os.close(self._lock_fd)
        self._agent = None
