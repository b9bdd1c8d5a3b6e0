"""Tiered store: a fast local tier (Dual-Blade on NVMe) in front of a shared one (S3, POSIX), fastest first.

``{"backend": "tiered", "tiers": [{"backend": "dualblade", ...}, {"backend": "s3", ...}]}``

- lookup: the leading run present in *any* tier (a chunk evicted locally is
  still a hit in the shared tier);
- read: each tier in turn reads what the tiers before it missed (a tier that
  fails is a miss there); a chunk a lower tier served is copied into a fill
  buffer (one memcpy, the only cost the load sees) and written to the tiers
  above it by a background thread (with no free fill slot the fill is skipped
  and counted);
- write: through every tier, the shared one first; the chunk counts as stored
  when the last (the shared, durable) tier stored it, and a local tier's
  failure is logged, never a failed save;
- delete: from every tier, and from fills still queued (a reader that found a
  chunk corrupt must not see it filled back).
"""

from __future__ import annotations

import copy
import ctypes
import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nixl_backends.buffers import HostBufferPool, PoolExhausted
from nixl_backends.configuration import ConfigError
from nixl_backends.layout import BlockLayout
from nixl_backends.store import KVStore, StoreMetrics, TransferAbandoned

logger = logging.getLogger(__name__)

# How long close() waits for queued fills before dropping them.
_CLOSE_DRAIN_S = 30.0


@dataclass
class TieredStoreConfig:
    tiers: list  # store sections, fastest first
    # Host memory for fills in flight (whole chunk objects); a fill that finds no room is skipped, and the
    # chunk is filled the next time it is read. 0: no fills.
    fill_buffer_bytes: int = 256 << 20
    tier_configs: list = field(init=False, default_factory=list)

    @property
    def locality(self) -> str:
        """REMOTE when any tier is (a chunk is announced once durable, and the shared tier is where it lasts)."""
        return "REMOTE" if any(tier.locality == "REMOTE" for tier in self.tier_configs) else "LOCAL"

    def validate(self) -> None:
        from nixl_backends.registry import parse_store_config

        if len(self.tiers) < 2:
            raise ConfigError(f"store.tiers needs at least two store sections, got {len(self.tiers)}")
        self.tier_configs = [_parse_tier(parse_store_config, tier, i) for i, tier in enumerate(self.tiers)]
        if any(isinstance(config, TieredStoreConfig) for config in self.tier_configs):
            raise ConfigError("store.tiers: a tier cannot itself be tiered")
        if self.fill_buffer_bytes < 0:
            raise ConfigError(f"store.fill_buffer_bytes must be >= 0, got {self.fill_buffer_bytes}")

    def for_rank(self, tp_rank: int, pp_rank: int) -> TieredStoreConfig:
        """The section one engine rank opens: each tier's own (a local tier's root per rank)."""
        from nixl_backends.registry import for_rank

        ranked = copy.copy(self)
        ranked.tier_configs = [for_rank(config, tp_rank, pp_rank) for config in self.tier_configs]
        return ranked


def _parse_tier(parse: Any, section: dict, index: int) -> Any:
    where = f"store.tiers[{index}]."
    try:
        return parse(section, where)
    except ConfigError as exc:
        # Backends' own cross-field checks name keys as "store.<key>": say which tier's.
        message = str(exc)
        raise ConfigError(message if where in message else message.replace("store.", where, 1)) from None


def _memory(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class TieredStore(KVStore):
    def __init__(self, config: TieredStoreConfig, layout: BlockLayout, agent=None) -> None:
        from nixl_backends.registry import make_store

        super().__init__(layout)
        self.config = config
        self.tiers: list[KVStore] = []
        try:
            for tier_config in config.tier_configs:
                self.tiers.append(make_store(tier_config, layout, agent))
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        self._counters: Counter[str] = Counter(local_tier_filled_chunks=0, local_tier_fill_skipped_chunks=0)
        self._counter_lock = threading.Lock()
        # Keys in queued fills, and those of them deleted since (under _counter_lock).
        self._pending: Counter[str] = Counter()
        self._cancelled: set[str] = set()
        self._fills: queue.Queue[tuple[int, list[str], list[int]] | None] = queue.Queue()
        self._pool: HostBufferPool | None = None
        self._filler: threading.Thread | None = None
        if agent is not None and config.fill_buffer_bytes:
            # After the tiers: their backends must exist before memory is registered. At least one slot.
            slots = max(1, config.fill_buffer_bytes // layout.object_bytes)
            self._pool = HostBufferPool(agent, layout.object_bytes, slots)
            self._filler = threading.Thread(target=self._fill_loop, name="dualpath-tier-fill", daemon=True)
            self._filler.start()

    def lookup(self, keys: Sequence[str]) -> int:
        # Union of the tiers' leading runs: each round advances by the longest run any tier has from here.
        position = 0
        while position < len(keys):
            step = 0
            for tier in self.tiers:
                step = max(step, tier.lookup(keys[position:]))
                if step == len(keys) - position:
                    break
            if step == 0:
                break
            position += step
        return position

    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        ok = [False] * len(keys)
        remaining = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not remaining:
                break
            try:
                got = tier.read([keys[i] for i in remaining], [dst_addrs[i] for i in remaining])
            except TransferAbandoned:
                raise  # NIXL may still write the destinations: no other tier may read into them
            except Exception:
                if level == len(self.tiers) - 1:
                    raise
                # A failing local tier (a full disk, an I/O error) is a miss there, never a failed load.
                logger.exception("tiered store: tier %d failed a read; reading from the next tier", level)
                got = [False] * len(remaining)
            served = [i for i, good in zip(remaining, got) if good]
            for i in served:
                ok[i] = True
            if level and served:
                self._queue_fill(level, [keys[i] for i in served], [dst_addrs[i] for i in served])
            remaining = [i for i, good in zip(remaining, got) if not good]
        return ok

    def _queue_fill(self, level: int, keys: list[str], addrs: list[int]) -> None:
        """Copy chunks a lower tier served into fill slots (one memcpy each) for the filler to write upwards."""
        if self._pool is None:
            return
        try:
            slots = self._pool.acquire(len(keys))
        except PoolExhausted:
            try:
                slots = self._pool.acquire(min(len(keys), self._pool.free_slots))
            except PoolExhausted:  # another reader took them meanwhile
                slots = []
        size = self.layout.object_bytes
        for slot, addr in zip(slots, addrs):
            np.copyto(self._pool.slot_view(slot), _memory(addr, size))
        if len(slots) < len(keys):
            with self._counter_lock:
                self._counters["local_tier_fill_skipped_chunks"] += len(keys) - len(slots)
        if slots:
            with self._counter_lock:
                self._pending.update(keys[: len(slots)])
            self._fills.put((level, keys[: len(slots)], slots))

    def _fill_loop(self) -> None:
        while (job := self._fills.get()) is not None:
            level, keys, slots = job
            try:
                filled = [True] * len(keys)
                for tier in self.tiers[:level]:
                    written = tier.write(keys, [self._pool.slot_addr(s) for s in slots])
                    filled = [a and b for a, b in zip(filled, written)]
                with self._counter_lock:
                    cancelled = [key for key in keys if key in self._cancelled]
                for tier in self.tiers[:level]:
                    tier.delete(cancelled)  # deleted while this fill was queued or being written
                with self._counter_lock:
                    self._counters["local_tier_filled_chunks"] += sum(filled) - len(cancelled)
                    self._counters["local_tier_fill_skipped_chunks"] += len(keys) - sum(filled) + len(cancelled)
            except Exception:
                logger.exception("tiered store: filling %d chunk(s) into the upper tiers failed", len(keys))
            finally:
                with self._counter_lock:
                    self._pending.subtract(keys)
                    for key in keys:
                        if self._pending[key] <= 0:
                            del self._pending[key]
                            self._cancelled.discard(key)
                self._pool.release(slots)

    def wait_for_fills(self, timeout_s: float = _CLOSE_DRAIN_S) -> bool:
        """Whether every queued fill was written within ``timeout_s`` (tests and close)."""
        from nixl_backends.nixl_io import wait_until

        # A fill holds its slots until written (or failed), so all slots free means no fill is pending.
        return self._pool is None or wait_until(lambda: self._pool.free_slots == self._pool.num_slots, timeout_s)

    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        # The shared tier first: it decides what counts as stored, and a local failure must not keep a chunk
        # from it. (A transfer the local tier abandons only reads the sources.)
        stored = self.tiers[-1].write(keys, src_addrs)
        for level, tier in enumerate(self.tiers[:-1]):
            try:
                tier.write(keys, src_addrs)
            except Exception:
                logger.exception("tiered store: tier %d failed a write of %d chunk(s)", level, len(keys))
        return stored

    def delete(self, keys: Sequence[str]) -> None:
        with self._counter_lock:
            # A fill still queued for one of these must not bring it back (the reader dropped it as corrupt).
            self._cancelled.update(key for key in keys if key in self._pending)
        for tier in self.tiers:
            tier.delete(keys)

    def metrics(self) -> StoreMetrics:
        merged = StoreMetrics()
        with self._counter_lock:
            counters: Counter[str] = Counter(self._counters)
        for tier in self.tiers:
            own = tier.metrics()
            counters.update(own.counters)
            merged.gauges.update(own.gauges)
        merged.counters = dict(counters)
        return merged

    def close(self) -> None:
        if self._filler is not None:
            self.wait_for_fills()
            self._fills.put(None)
            self._filler.join(timeout=_CLOSE_DRAIN_S)
            self._filler = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for tier in self.tiers:
            tier.close()

