"""Our stores as LMCache L2 adapters: one adapter class for every backend of the registry.

LMCache's multi-process server (``lmcache server``) keeps KV chunks in CPU
memory (L1) and hands them to L2 adapters to persist. This module is such an
adapter over any :class:`~nixl_backends.store.KVStore` (``s3``, ``s3agg``,
``posix``, ``dualblade``, ``tiered``), loaded by LMCache's plugin loader::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "nixl_backends.lmcache_l2", "class_name": "DualPathL2Adapter",
        "adapter_params": {"store": {"backend": "s3", "endpoint": "http://127.0.0.1:8333",
                                     "bucket": "kv"}}}'

(the config class ``DualPathL2AdapterConfig`` is found by LMCache's naming
convention and validates ``adapter_params`` once, naming a bad key).

How LMCache's objects map onto ours:

- Keys: an ``ObjectKey``'s model name, KV rank, object group and cache
  salt, with the object's byte size, the integrity tag and the chunk hash's
  length, form a family (:mod:`nixl_backends.lmcache_names`) whose namespace
  is the digest of its record; the object is stored at
  ``<key_prefix>/<namespace>/<hh>/<name>``, like every chunk of ours, its
  name being the chunk hash itself (zero-padded; a hash over 32 bytes: its
  digest), and the record once at ``<key_prefix>/families/<namespace>``.
  Different models, ranks, groups, salts, sizes or integrity modes never
  share an object; the trailer is sealed with the family and the hash, so an
  object copied into another family fails its check.
- Listing: ``list_l2_keys`` reads the family records (each checked against
  its namespace) and lists their objects in key order, a page per call; the
  cursor is the last key listed. At start a background scan of the same
  listing accounts every object of this integrity tag
  (``adopt_stored_objects``), so LMCache's usage and eviction see the whole
  bucket, whoever stored it.
- Objects: a memory object's bytes plus our integrity trailer
  (:mod:`nixl_backends.integrity`), one digest per object. The trailer cannot
  be appended inside LMCache's buffer, so every object goes through a staging
  slot of a NIXL-registered pool (:class:`~nixl_backends.buffers.HostBufferPool`):
  one native memcpy from LMCache's buffer into the slot, seal, NIXL moves the
  slot to the store; a load reads into a slot, verifies, and only a verified
  object is copied into LMCache's buffer. So a missing, short or corrupt object
  is a failed load bit, never wrong bytes, and no NIXL transfer ever writes
  LMCache's memory (a transfer abandoned at its deadline keeps its slot, not
  LMCache's buffer). A corrupt object is deleted, so the next store rewrites it.
- Stores are opened per object size (a store's layout fixes its object size):
  the first task of a size opens a NIXL agent, the store and its two staging
  pools. ``posix``, ``s3`` and ``s3agg`` hold any number of sizes under one root
  or bucket; a ``dualblade`` tier holds one (its extents have one size), so a
  second size fails to open (its writer lock is held) and its tasks fail.
- Locks: ``submit_lookup_and_lock_task`` answers a bit per key (every present
  key, not only a leading run: LMCache plans the prefix itself) and counts a
  lock on each hit; objects this adapter stored or found are answered from
  memory (:class:`~nixl_backends.lookup.PresentChunks`), the rest by the store
  (S3: HEADs in parallel); a failed load forgets its answer; ``submit_unlock`` releases one. An object a
  lookup found enters LMCache's byte accounting (``get_usage``) as one this adapter stored does. ``delete`` (LMCache's
  eviction) skips locked keys, as LMCache's own nixl_store adapter does. A
  store's own eviction (a full dualblade tier) and ``dualpath-kv gc`` do not
  ask LMCache: a locked key they removed is a failed load bit, as with
  LMCache's fs adapter when a file disappears.
- Completion: three eventfds (LMCache's notifiers), one per operation; each
  operation runs on its own worker thread, so loads never wait behind stores.

lmcache is imported here only (the ``dualpath-kv[lmcache]`` extra); nothing
else of ours imports this module.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from nixl_backends.buffers import HostBufferPool
from nixl_backends.configuration import ConfigError, from_dict, refuse_secret
from nixl_backends.integrity import DEFAULT_INTEGRITY, ChunkIntegrity, IntegrityMode, integrity_key_from_env, integrity_tag
from nixl_backends.gc import ChunkObjects, GcError, open_chunks
from nixl_backends.layout import BlockLayout
from nixl_backends.lmcache_names import RECORD_WINDOW, Family, FamilyRecords, KeyListing, ListedKey, object_name
from nixl_backends.lookup import PresentChunks
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.abandoned import retire_slots
from nixl_backends.store import KVStore, TransferAbandoned

__all__ = ["DualPathL2Adapter", "DualPathL2AdapterConfig", "LMCacheL2Params", "family_of", "store_key"]

logger = logging.getLogger(__name__)

_WHERE = "adapter_params."
# Keys adopted per notification of LMCache's accounting while a start-up scan runs.
_ADOPT_BATCH = 1000


@dataclass
class LMCacheL2Params:
    """``adapter_params`` of ``--l2-adapter '{"type": "plugin", ...}'``."""

    # A store section, as in the connector's kv_connector_extra_config: {"backend": "s3" | "s3agg" | "posix" |
    # "dualblade" | "tiered", ...}. Credentials come from the environment (AWS_*), never from here.
    store: dict
    # First component of every object key; keeps LMCache's objects apart from the connector's ("dualpath").
    key_prefix: str = "lmcache"
    # "keyed" (BLAKE3 MAC under $DUALPATH_INTEGRITY_KEY) or "checksum" (XXH3-128: no defence against a writer).
    integrity: IntegrityMode = DEFAULT_INTEGRITY
    # Registered host memory per object size and direction (stores, loads) that objects pass through;
    # a task with more objects than fit runs in several rounds. At least one slot.
    staging_buffer_bytes: int = 128 << 20
    # Presence checks in flight at once during a lookup (S3: HEADs).
    lookup_concurrency: int = 16
    # Objects remembered as present (stored or found by this adapter), answered without a store round trip.
    lookup_cache_chunks: int = 100_000
    # A remembered answer expires this long after the store gave it (null: never). Set it when something
    # else deletes objects (`dualpath-kv gc`, a lifecycle rule): until then a deleted object is a failed load.
    lookup_cache_ttl_s: float | None = None
    # Capacity LMCache's L2 eviction may enforce through delete(); 0: unbounded (the store bounds itself).
    max_capacity_bytes: int = 0
    # At start, account every object of this integrity tag already under key_prefix (a background scan), so
    # LMCache's usage and eviction see the whole bucket, not only what this server stored or found. The
    # accounting holds each object's key in memory (a few hundred bytes each): off for a bucket of billions.
    adopt_stored_objects: bool = True
    store_config: Any = field(default=None, init=False, repr=False)
    integrity_key: bytes | None = field(default=None, init=False, repr=False)

    def validate(self) -> None:
        # LMCache logs its adapter specs, and the JSON sits on the server's command line (ps).
        refuse_secret(self.store, f"{_WHERE}store", "LMCache's log and command line")
        self.store_config = parse_store_config(self.store, f"{_WHERE}store.")
        self.integrity_key = integrity_key_from_env(self.integrity, _WHERE)
        for name in ("staging_buffer_bytes", "lookup_concurrency", "lookup_cache_chunks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_WHERE}{name} must be positive, got {getattr(self, name)}")
        if self.lookup_cache_ttl_s is not None and self.lookup_cache_ttl_s <= 0:
            raise ConfigError(f"{_WHERE}lookup_cache_ttl_s must be positive or null, got {self.lookup_cache_ttl_s}")
        if self.max_capacity_bytes < 0:
            raise ConfigError(f"{_WHERE}max_capacity_bytes must be >= 0, got {self.max_capacity_bytes}")
        if not self.key_prefix.strip("/"):
            raise ConfigError(f"{_WHERE}key_prefix must not be empty")


class DualPathL2AdapterConfig(L2AdapterConfigBase):
    """What LMCache's plugin loader builds from ``adapter_params`` (found as ``<class_name>Config``)."""

    def __init__(self, params: LMCacheL2Params) -> None:
        self.params = params

    @classmethod
    def from_dict(cls, d: dict) -> DualPathL2AdapterConfig:
        return cls(from_dict(LMCacheL2Params, d, _WHERE))

    @classmethod
    def help(cls) -> str:
        return "dualpath-kv L2 adapter: adapter_params " + ", ".join(
            name for name in LMCacheL2Params.__dataclass_fields__ if name not in ("store_config", "integrity_key")
        )


def family_of(key: ObjectKey, object_bytes: int, tag: str) -> Family:
    """The family of LMCache's ``key`` for an object of ``object_bytes`` bytes (:mod:`~nixl_backends.lmcache_names`)."""
    return Family(key.model_name, key.kv_rank, key.object_group_id, key.cache_salt, object_bytes, tag,
                  len(key.chunk_hash))  # fmt: skip


def store_key(prefix: str, key: ObjectKey, object_bytes: int, tag: str) -> tuple[str, str]:
    """(our store key, its sealing hash) for LMCache's ``key`` of an object of ``object_bytes`` bytes."""
    return object_name(prefix, family_of(key, object_bytes, tag), bytes(key.chunk_hash))


def _object_key(listed: ListedKey) -> ObjectKey:
    family = listed.family
    return ObjectKey(chunk_hash=listed.chunk_hash, model_name=family.model_name, kv_rank=family.kv_rank,
                     object_group_id=family.object_group_id, cache_salt=family.cache_salt)  # fmt: skip


def layout_bytes(desc: MemoryLayoutDesc | None) -> int:
    """Bytes of an object of layout ``desc`` (LMCache's own rule: sum of numel * itemsize); 0 if unknown."""
    if desc is None:
        return 0
    return sum(shape.numel() * dtype.itemsize for shape, dtype in zip(desc.shapes, desc.dtypes, strict=True))


def _bytes_of(obj: MemoryObj) -> np.ndarray:
    """An object's logical bytes as a writable uint8 view (no copy)."""
    return np.frombuffer(obj.byte_array, dtype=np.uint8)


class _SizedStore:
    """The store, NIXL agent and staging pools for objects of one size."""

    _names = itertools.count()

    def __init__(self, params: LMCacheL2Params, object_bytes: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.object_bytes = object_bytes
        self.layout = BlockLayout(num_layers=1, layer_block_bytes=object_bytes)
        self.integrity = ChunkIntegrity(self.layout, params.integrity_key)
        # One agent per size: a store's NIXL backends (OBJ, POSIX) are opened once per agent.
        self.agent = nixl_agent(f"lmcache-l2-{os.getpid()}-{next(self._names)}", nixl_agent_config(backends=[]))
        self.store: KVStore = make_store(params.store_config, self.layout, self.agent)
        slots = max(1, params.staging_buffer_bytes // self.layout.object_bytes)
        try:
            # After the store: its backends must exist before memory is registered.
            self.store_pool = HostBufferPool(self.agent, self.layout.object_bytes, slots)
            self.load_pool = HostBufferPool(self.agent, self.layout.object_bytes, slots)
        except BaseException:
            self.store.close()
            raise
        self.slots = slots

    def close(self) -> None:
        self.store.close()
        self.store_pool.close()
        self.load_pool.close()


def _rounds(indices: Sequence[int], size: int) -> list[Sequence[int]]:
    return [indices[start : start + size] for start in range(0, len(indices), size)]


class DualPathL2Adapter(L2AdapterInterface):
    """An LMCache L2 adapter over the store ``adapter_params.store`` names (see the module docstring)."""

    def __init__(self, config: DualPathL2AdapterConfig | dict, l1_memory_desc: Any = None) -> None:
        if isinstance(config, dict):  # a loader that passes adapter_params as they are
            config = DualPathL2AdapterConfig.from_dict(config)
        self.params = config.params
        super().__init__(max_capacity_bytes=self.params.max_capacity_bytes)
        self._tag = integrity_tag(self.params.integrity_key)
        self._prefix = self.params.key_prefix.strip("/")
        # Reachable with these credentials before LMCache starts serving: a wrong endpoint or key stops start-up.
        make_store(self.params.store_config, BlockLayout(1, 4096)).close()
        # Small objects beside the chunks (family records) and listings; None where the store has no
        # listing (a dualblade tier alone): then keys are neither listed nor adopted at start.
        objects: ChunkObjects | None = None
        try:
            objects = open_chunks(self.params.store_config, self._prefix, connections=RECORD_WINDOW)
        except GcError as exc:
            logger.info("dualpath L2 adapter: no key listing on this store (%s)", exc)
        self._records = self._key_listing = None
        if objects is not None:
            self._records = FamilyRecords(objects, self._prefix)
            self._key_listing = KeyListing(objects, self._prefix, self._tag)
        self._sized: dict[int, _SizedStore] = {}
        self._sized_lock = threading.Lock()
        self._state = threading.Lock()
        self._task_ids = itertools.count()
        self._locks: Counter[ObjectKey] = Counter()
        # Objects in the accounting: stored by this adapter, or found by its lookups (key -> bytes).
        self._stored: dict[ObjectKey, int] = {}
        self._group_bytes: dict[tuple[str, int], int] = {}  # (model, object group) -> object size seen
        self._known = PresentChunks(self.params.lookup_cache_chunks, ttl_s=self.params.lookup_cache_ttl_s)
        self._store_results: dict[L2TaskId, L2StoreResult] = {}
        self._lookup_results: dict[L2TaskId, Bitmap] = {}
        self._load_results: dict[L2TaskId, Bitmap] = {}
        self._counters: Counter[str] = Counter()
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        # One thread per operation: a load never waits behind a store (as the connector's I/O lanes).
        self._store_lane = ThreadPoolExecutor(1, thread_name_prefix="lmcache-l2-store")
        self._lookup_lane = ThreadPoolExecutor(1, thread_name_prefix="lmcache-l2-lookup")
        self._load_lane = ThreadPoolExecutor(1, thread_name_prefix="lmcache-l2-load")
        self._presence = ThreadPoolExecutor(self.params.lookup_concurrency, thread_name_prefix="lmcache-l2-head")
        self._closed = False
        self._adopter: threading.Thread | None = None
        self._scan_state = "off"
        if self.params.adopt_stored_objects and self._key_listing is not None:
            self._scan_state = "running"
            self._adopter = threading.Thread(target=self._adopt_stored, name="lmcache-l2-adopt", daemon=True)
            self._adopter.start()
        logger.info("dualpath L2 adapter: store backend %s, key prefix %r, integrity %s",
                    type(self.params.store_config).__name__, self._prefix, self._tag)  # fmt: skip

    # ---- event fds ----

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ---- submissions (non-blocking) ----

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = next(self._task_ids)
        self._store_lane.submit(self._run_store, task_id, list(keys), list(objects))
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._state:
            done, self._store_results = self._store_results, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]) -> L2TaskId:  # fmt: skip
        task_id = next(self._task_ids)
        self._lookup_lane.submit(self._run_lookup, task_id, list(keys), dict(group_layout_descs or {}))
        return task_id

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._state:
            return self._lookup_results.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        # Synchronous and cannot fail: LMCache never retries an unlock.
        with self._state:
            for key in keys:
                if self._locks[key] > 1:
                    self._locks[key] -= 1
                else:
                    self._locks.pop(key, None)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = next(self._task_ids)
        self._load_lane.submit(self._run_load, task_id, list(keys), list(objects))
        return task_id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._state:
            return self._load_results.pop(task_id, None)

    # ---- eviction, status, close ----

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove unlocked objects this adapter stored or found; a locked key stays (LMCache retries it later)."""
        with self._state:
            # (A Counter answers 0 for a missing key without adding it.)
            doomed = [(key, self._stored.pop(key)) for key in keys if key in self._stored and not self._locks[key]]
        by_size: dict[int, list[str]] = {}
        for key, size in doomed:
            by_size.setdefault(size, []).append(store_key(self._prefix, key, size, self._tag)[0])
        for size, store_keys in by_size.items():
            self._known.forget(store_keys)
            try:
                self._sized_store(size).store.delete(store_keys)
            except Exception:
                logger.exception("dualpath L2 adapter: deleting %d objects failed", len(store_keys))
        if doomed:
            self._count(deleted_objects=len(doomed))
            self._notify_keys_deleted([key for key, _ in doomed], [size for _, size in doomed])

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> KeyListPage:  # fmt: skip
        """The keys stored under ``key_prefix`` with this integrity tag (whoever stored them), in key order.

        ``cursor``: the previous page's ``next_page_token`` (the last store key it listed).
        """
        listing = self._key_listing
        if listing is None:
            raise NotImplementedError(f"{type(self.params.store_config).__name__} has no key listing")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        if cursor is not None:
            listing.check_cursor(cursor)
        entries: list[KeyEntry] = []
        last = None
        for listed in listing.keys(listing.families(model_name), cursor):
            if len(entries) == page_size:
                return KeyListPage(entries=tuple(entries), next_page_token=last)
            entries.append(KeyEntry(key=_object_key(listed).to_encoded_object_key(),
                                    size_bytes=listed.family.object_bytes))  # fmt: skip
            last = listed.store_key
        return KeyListPage(entries=tuple(entries), next_page_token=None)

    def _adopt_stored(self) -> None:
        """The start-up scan: every listable object of this tag enters the accounting (counted ``adopted_objects``)."""
        batch: list[tuple[ObjectKey, int]] = []
        try:
            listing = self._key_listing
            for listed in listing.keys(listing.families()):
                if self._closed:
                    self._scan_state = "stopped"
                    return
                batch.append((_object_key(listed), listed.family.object_bytes))
                if len(batch) == _ADOPT_BATCH:
                    self._adopt(batch)
                    batch = []
            self._adopt(batch)
        except Exception:
            logger.exception("dualpath L2 adapter: the start-up scan of stored objects failed; objects it did not "
                             "reach are accounted once a lookup finds them")  # fmt: skip
            self._scan_state = "failed"
            return
        self._scan_state = "ended"
        logger.info("dualpath L2 adapter: start-up scan ended; %d stored objects accounted",
                    self._counters["adopted_objects"])  # fmt: skip

    def _adopt(self, found: list[tuple[ObjectKey, int]]) -> None:
        """Objects found in the store (by the start-up scan or a lookup) enter the accounting, once each."""
        with self._state:
            adopted = [(key, size) for key, size in found if key not in self._stored]
            for key, size in adopted:
                self._stored[key] = size
            self._counters.update(adopted_objects=len(adopted))
        if adopted:
            self._notify_keys_stored([key for key, _ in adopted], [size for _, size in adopted])

    def report_status(self) -> dict:
        with self._state:
            status = {
                "is_healthy": not self._closed,
                "type": type(self).__name__,
                "store": type(self.params.store_config).__name__,
                "locked_keys": len(self._locks),
                "stored_objects_known": len(self._stored),
                "startup_scan": self._scan_state,
                **self._counters,
            }
        with self._sized_lock:
            status["object_sizes"] = sorted(self._sized)
        return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._adopter is not None:
            self._adopter.join()  # it checks _closed between objects
        for lane in (self._store_lane, self._lookup_lane, self._load_lane, self._presence):
            lane.shutdown(wait=True)
        if self._records is not None:
            self._records.close()  # after the store lane: no store round writes records any more
        with self._sized_lock:
            for sized in self._sized.values():
                sized.close()
            self._sized.clear()
        for notifier in (self._store_efd, self._lookup_efd, self._load_efd):
            notifier.close()

    # ---- the work, on the lanes ----

    def _count(self, **amounts: int) -> None:
        with self._state:
            self._counters.update(amounts)

    def _sized_store(self, object_bytes: int) -> _SizedStore:
        with self._sized_lock:
            sized = self._sized.get(object_bytes)
            if sized is None:
                sized = self._sized[object_bytes] = _SizedStore(self.params, object_bytes)
                logger.info("dualpath L2 adapter: opened the store for %d-byte objects (%d staging slots)",
                            object_bytes, sized.slots)  # fmt: skip
            return sized

    def _finish(self, results: dict, task_id: L2TaskId, result: Any, notifier: Any) -> None:
        with self._state:
            results[task_id] = result
        notifier.notify()

    def _run_store(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        success, written = True, 0
        try:
            with self._state:
                todo = [i for i, key in enumerate(keys) if key not in self._stored]  # already stored: skipped
            for size, indices in self._by_size(keys, objects, todo).items():
                sized = self._sized_store(size)
                for batch in _rounds(indices, sized.slots):
                    stored = self._store_round(sized, [keys[i] for i in batch], [objects[i] for i in batch])
                    success &= len(stored) == len(batch)
                    written += size * len(stored)
        except Exception:
            logger.exception("dualpath L2 adapter: store task %d failed", task_id)
            success = False
        self._finish(self._store_results, task_id, L2StoreResult(success, written), self._store_efd)

    def _store_round(self, sized: _SizedStore, keys: list[ObjectKey], objects: list[MemoryObj]) -> list[ObjectKey]:
        pool, size = sized.store_pool, sized.object_bytes
        if self._records is not None:
            # Before the objects: an object is listable (and adopted by a later start) once its family's record is.
            self._records.ensure({family_of(key, size, self._tag) for key in keys})
        slots = pool.acquire(len(keys))
        try:
            names = []
            for slot, key, obj in zip(slots, keys, objects):
                name, chunk_hash = store_key(self._prefix, key, size, self._tag)
                view = pool.slot_view(slot)
                np.copyto(view[:size], _bytes_of(obj))
                sized.integrity.seal(chunk_hash, view)
                names.append(name)
            ok = sized.store.write(names, [pool.slot_addr(slot) for slot in slots])
        except TransferAbandoned as exc:
            retire_slots(exc, pool, slots, "dualpath L2 adapter: a store")
            raise
        except BaseException:
            pool.release(slots)
            raise
        pool.release(slots)
        stored = [key for key, written in zip(keys, ok) if written]
        self._known.remember([name for name, written in zip(names, ok) if written])
        with self._state:
            for key in stored:
                self._stored[key] = size
        self._count(stored_objects=len(stored), stored_bytes=size * len(stored), failed_store_objects=len(keys) - len(stored))
        if stored:
            self._notify_keys_stored(stored, [size] * len(stored))
        return stored

    def _by_size(self, keys: list[ObjectKey], objects: list[MemoryObj], indices: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for i in indices:
            size = objects[i].get_size()
            groups.setdefault(size, []).append(i)
            self._group_bytes[(keys[i].model_name, keys[i].object_group_id)] = size
        return groups

    def _run_lookup(self, task_id: L2TaskId, keys: list[ObjectKey], descs: dict[int, MemoryLayoutDesc]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            sizes = [layout_bytes(descs.get(key.object_group_id))
                     or self._group_bytes.get((key.model_name, key.object_group_id), 0) for key in keys]  # fmt: skip
            names = {i: store_key(self._prefix, keys[i], size, self._tag)[0] for i, size in enumerate(sizes) if size}
            # Keys remembered as present are answered here; only the others cost a thread and a store request.
            remembered = {i for i, name in names.items() if self._known.known_run([name])}
            asked = [i for i in names if i not in remembered]
            found = self._presence.map(lambda i: self._present(names[i], sizes[i]), asked)
            hits = sorted(remembered.union(i for i, present in zip(asked, found) if present))
            with self._state:
                for i in hits:
                    bitmap.set(i)
                    self._locks[keys[i]] += 1
            # Objects another server (or this one before a restart) stored since the start-up scan enter the
            # accounting once found: LMCache's usage and eviction see them, and delete() may evict them.
            self._adopt([(keys[i], sizes[i]) for i in hits])
            self._count(lookup_keys=len(keys), lookup_hits=len(hits))
        except Exception:
            logger.exception("dualpath L2 adapter: lookup task %d failed", task_id)
            bitmap = Bitmap(len(keys))  # the failure is before the locking loop: nothing is locked
        self._finish(self._lookup_results, task_id, bitmap, self._lookup_efd)

    def _present(self, name: str, size: int) -> bool:
        """Whether the store holds the object ``name`` whole (asked of the store; remembered when it does)."""
        try:
            found = self._sized_store(size).store.lookup([name]) == 1
            if found:
                self._known.remember([name])
            return found
        except Exception:
            logger.exception("dualpath L2 adapter: lookup of %s failed", name)
            return False

    def _run_load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            for size, indices in self._by_size(keys, objects, range(len(keys))).items():
                sized = self._sized_store(size)
                for batch in _rounds(indices, sized.slots):
                    for i in self._load_round(sized, [keys[i] for i in batch], [objects[i] for i in batch]):
                        bitmap.set(batch[i])
        except Exception:
            logger.exception("dualpath L2 adapter: load task %d failed", task_id)
        loaded = [keys[i] for i in bitmap.get_indices_list()]
        if loaded:
            self._notify_keys_accessed(loaded)
        self._finish(self._load_results, task_id, bitmap, self._load_efd)

    def _load_round(self, sized: _SizedStore, keys: list[ObjectKey], objects: list[MemoryObj]) -> list[int]:
        """Indices (into ``keys``) of the objects read, verified and copied into their buffers."""
        pool, size = sized.load_pool, sized.object_bytes
        names = [store_key(self._prefix, key, size, self._tag) for key in keys]
        slots = pool.acquire(len(keys))
        try:
            ok = sized.store.read([name for name, _ in names], [pool.slot_addr(slot) for slot in slots])
            loaded, corrupt = [], []
            for i, (slot, (_, chunk_hash), read) in enumerate(zip(slots, names, ok)):
                view = pool.slot_view(slot)
                if not read:
                    continue
                if not sized.integrity.verify(chunk_hash, view):
                    corrupt.append(i)
                    continue
                np.copyto(_bytes_of(objects[i]), view[:size])
                loaded.append(i)
        except TransferAbandoned as exc:
            retire_slots(exc, pool, slots, "dualpath L2 adapter: a load")
            raise
        except BaseException:
            pool.release(slots)
            raise
        pool.release(slots)
        # A failed read is asked of the store again next time, and leaves the accounting: an object something
        # else deleted (gc, another server's eviction) is then stored again instead of skipped as stored.
        failed = set(range(len(keys))).difference(loaded)
        self._known.forget([names[i][0] for i in sorted(failed)])
        if corrupt:
            self._drop_corrupt(sized, [keys[i] for i in corrupt], [names[i][0] for i in corrupt])
        self._unaccount([keys[i] for i in sorted(failed.difference(corrupt))])
        self._count(loaded_objects=len(loaded), loaded_bytes=size * len(loaded),
                    missing_objects=len(keys) - len(loaded) - len(corrupt), corrupt_objects=len(corrupt))  # fmt: skip
        return loaded

    def _drop_corrupt(self, sized: _SizedStore, keys: list[ObjectKey], names: list[str]) -> None:
        # Deleted so the next store of the chunk writes it again instead of keeping a bad copy forever.
        logger.warning("dualpath L2 adapter: %d objects failed their integrity check and are deleted: %s",
                       len(names), ", ".join(names[:4]))  # fmt: skip
        try:
            sized.store.delete(names)
        except Exception:
            logger.exception("dualpath L2 adapter: deleting corrupt objects failed")
        self._unaccount(keys)

    def _unaccount(self, keys: list[ObjectKey]) -> None:
        with self._state:
            dropped = [(key, self._stored.pop(key)) for key in keys if key in self._stored]
        if dropped:
            self._notify_keys_deleted([key for key, _ in dropped], [size for _, size in dropped])
