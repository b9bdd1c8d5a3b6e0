"""Store garbage collection: keep chunk objects under a byte budget and/or an age, oldest-last-used first.

What ``dualpath-kv gc`` (:mod:`dualpath_connector.cli`) runs. It works on the keys of
:func:`nixl_backends.layout.chunk_key`, ``<prefix>/<namespace>/<hh>/<hash>``,
of one or more namespaces (or all under a prefix), in a POSIX root or an S3
bucket (an ``s3agg`` store through its bucket). Anything else under the prefix
is never touched. It only lists and deletes by key, size and time; it never
opens a chunk and does not depend on a chunk's size matching a layout.

**Last used.** POSIX: a file's mtime; the POSIX store refreshes it on every
successful read (chunks are immutable, so mtime means "last written or read";
atime is often not kept). S3: ``LastModified``, the time of the last PUT; S3
keeps no access time, so a bucket is trimmed oldest-*written* first (an S3
lifecycle expiration rule is the server-side alternative, see the README).

**Two passes, little memory.** The first pass lists every chunk and keeps only
its time and size (16 bytes each) to find the cutoff: everything last used
before time ``T``, and of the objects last used exactly at ``T`` (timestamps
are coarse: S3's have seconds) enough bytes to meet the budget. The second pass
lists again and deletes what falls under the cutoff, in batches. A chunk read or
rewritten between the passes has a newer time and stays; a chunk written
meanwhile is newer than the cutoff and stays; the next run trims them.

**Safe against concurrent readers and writers.** Deleting is the only change
gc makes; it never truncates or overwrites in place, so no reader can see a
half-deleted chunk:

- POSIX: ``unlink`` removes the name only. A reader that already opened the
  file keeps its descriptor and reads every byte of the inode, which lives until
  the last descriptor closes; a later open fails, which the store reports as a
  miss. Directories are never removed: a writer creates the ``<hh>`` directory
  and then its temporary file in it, and removing an empty directory between
  the two would fail that write.
- S3: ``DeleteObject(s)`` is atomic per key: a GET either returns the whole
  object or 404, a miss (a ranged GET in flight is served whole from the
  version it started on).
- A deleted chunk is recomputed and saved again by the next request that
  needs it; a lookup cache that still remembers it present is corrected by the
  failed load (and by :class:`nixl_backends.lookup.PresentChunks`' ``ttl_s``).

**Interrupted writes.** The POSIX store writes ``<hash>.<random>.tmp`` and
renames it into place; a crash leaves the temporary file behind. Those not
written to for longer than ``partial_max_age_s`` (far beyond any write's
deadline, ``store.io_timeout_s``) are removed too. Unlinking one that a writer
still held would only fail that one save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol

import numpy as np

from nixl_backends.layout import HASH_HEX_CHARS
from nixl_backends.posix import PosixStoreConfig

logger = logging.getLogger(__name__)

# DeleteObjects takes at most 1000 keys per request.
DELETE_BATCH = 1000
_NS_PER_S = 1_000_000_000
_HEX = re.compile(r"[0-9a-f]+")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class GcError(ValueError):
    """The store cannot be collected as configured (e.g. a POSIX root that does not exist)."""


@dataclass(frozen=True)
class StoredObject:
    key: str
    namespace: str
    size: int
    # Last used, nanoseconds since the epoch (POSIX mtime, S3 LastModified).
    used_ns: int
    # A POSIX write's temporary file, left by an interrupted write.
    partial: bool = False


@dataclass(frozen=True)
class GcPolicy:
    """What to keep: at most ``max_bytes`` of chunks, none unused for longer than ``max_age_s``."""

    max_bytes: int | None = None
    max_age_s: float | None = None
    partial_max_age_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_bytes is None and self.max_age_s is None:
            raise ValueError("a gc policy needs max_bytes and/or max_age_s")
        for name in ("max_bytes", "max_age_s", "partial_max_age_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")


@dataclass(frozen=True)
class Cutoff:
    """Objects last used before ``used_ns`` go, and of those used exactly then, ``tie_bytes`` worth."""

    used_ns: int
    tie_bytes: int = 0


def plan_cutoff(used_ns: np.ndarray, sizes: np.ndarray, policy: GcPolicy, now_ns: int) -> Cutoff | None:
    """The cutoff that meets ``policy`` for chunks of these times and sizes; None when all may stay.

    Both rules delete an oldest-first prefix of the chunks, so together they
    delete the longer of the two prefixes.
    """
    age = None
    if policy.max_age_s is not None:
        age = Cutoff(now_ns - int(policy.max_age_s * _NS_PER_S))
    budget = None
    need = int(sizes.sum()) - policy.max_bytes if policy.max_bytes is not None else 0
    if need > 0:
        order = np.argsort(used_ns, kind="stable")
        last = int(np.searchsorted(np.cumsum(sizes[order]), need))  # the first prefix with >= need bytes
        at = int(used_ns[order[last]])
        budget = Cutoff(at, need - int(sizes[used_ns < at].sum()))
    if budget is None or (age is not None and age.used_ns > budget.used_ns):
        return age
    return budget


class Selection:
    """Which listed objects go: chunks under the cutoff, and stale partial writes."""

    def __init__(self, cutoff: Cutoff | None, partial_before_ns: int) -> None:
        self.cutoff = cutoff
        self.partial_before_ns = partial_before_ns
        self._tie_bytes_left = cutoff.tie_bytes if cutoff else 0

    def takes(self, obj: StoredObject) -> bool:
        if obj.partial:
            return obj.used_ns < self.partial_before_ns
        if self.cutoff is None or obj.used_ns > self.cutoff.used_ns:
            return False
        if obj.used_ns < self.cutoff.used_ns:
            return True
        if self._tie_bytes_left <= 0:
            return False
        self._tie_bytes_left -= obj.size
        return True


class ChunkObjects(Protocol):
    """The chunk objects of a store, as gc sees them: listed, deleted, described.

    The small-object calls (``put``, ``get``, ``list_keys``, ``delete_keys``)
    carry gc's removal records (:mod:`nixl_backends.removals`) beside the chunks.
    """

    def scan(self, start_after: str | None = None) -> Iterator[StoredObject]:
        """The chunks, in key order (S3's: by UTF-8 bytes); with ``start_after``, those whose key sorts after it."""
        ...

    def delete(self, batch: Sequence[StoredObject]) -> list[StoredObject]:
        """Delete ``batch``; returns the objects now gone (failures are logged and left out)."""
        ...

    def describe(self) -> str: ...

    def selecting(self, namespaces: Sequence[str]) -> ChunkObjects:
        """The same store, scanning only the chunks of ``namespaces``."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` whole (a reader sees all of it or nothing)."""
        ...

    def get(self, key: str, limit: int) -> bytes | None:
        """At most ``limit`` + 1 bytes of ``key`` (so a caller can tell it is too long); None if absent."""
        ...

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (a ``/``-terminated key prefix)."""
        ...

    def delete_keys(self, keys: Sequence[str]) -> None: ...


class KeyPattern:
    """Parses ``<prefix>/<namespace>/<hh>/<hash>`` (and the POSIX writer's ``<hash>.<hex>.tmp``)."""

    def __init__(self, prefix: str, namespaces: Sequence[str] | None) -> None:
        self.prefix = prefix.strip("/")
        self.namespaces = list(namespaces) if namespaces is not None else None
        head = re.escape(self.prefix + "/") if self.prefix else ""
        self._pattern = re.compile(
            rf"{head}(?P<ns>[0-9a-f]+)/(?P<hh>[0-9a-f]{{2}})/(?P<hash>[0-9a-f]{{{HASH_HEX_CHARS}}})"
            r"(?P<tmp>\.[0-9a-f]+\.tmp)?"
        )

    def parse(self, key: str) -> tuple[str, bool] | None:
        """(namespace, partial) of a chunk key gc may delete, else None."""
        match = self._pattern.fullmatch(key)
        if match is None or match["hash"][:2] != match["hh"]:
            return None
        if self.namespaces is not None and match["ns"] not in self.namespaces:
            return None
        return match["ns"], match["tmp"] is not None

    def list_prefixes(self) -> list[str]:
        """Key prefixes that hold every selected chunk (S3 lists by prefix)."""
        head = f"{self.prefix}/" if self.prefix else ""
        if self.namespaces is None:
            return [head]
        return [f"{head}{ns}/" for ns in self.namespaces]


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


class PosixChunks:
    """Chunk files under a POSIX root."""

    def __init__(self, root: str, keys: KeyPattern) -> None:
        self.root = os.path.abspath(root)
        if not os.path.isdir(self.root):
            raise GcError(f"store.root: no such directory {root!r}")
        self.keys = keys

    def describe(self) -> str:
        return f"posix root {self.root}"

    def selecting(self, namespaces: Sequence[str]) -> PosixChunks:
        return PosixChunks(self.root, KeyPattern(self.keys.prefix, namespaces))

    def scan(self, start_after: str | None = None) -> Iterator[StoredObject]:
        base = os.path.join(self.root, *self.keys.prefix.split("/")) if self.keys.prefix else self.root
        head = f"{self.keys.prefix}/" if self.keys.prefix else ""
        namespaces = self.keys.namespaces
        if namespaces is None:
            namespaces = [e.name for e in _scandir(base) if _HEX.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        # Sorted level by level: hex names sort as their keys do ('/' sorts before every hex digit).
        for ns in sorted(namespaces):
            if _sorts_before(f"{head}{ns}/", start_after):
                continue
            for fan in sorted(_scandir(os.path.join(base, ns)), key=lambda e: e.name):
                if not fan.is_dir(follow_symlinks=False) or _sorts_before(f"{head}{ns}/{fan.name}/", start_after):
                    continue
                for entry in sorted(_scandir(fan.path), key=lambda e: e.name):
                    key = f"{head}{ns}/{fan.name}/{entry.name}"
                    parsed = self.keys.parse(key)
                    if parsed is None or not entry.is_file(follow_symlinks=False):
                        continue
                    if start_after is not None and key <= start_after:
                        continue
                    try:
                        stat = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted since the directory was listed
                    yield StoredObject(key, ns, stat.st_size, stat.st_mtime_ns, parsed[1])

    def put(self, key: str, data: bytes) -> None:
        path = os.path.join(self.root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Renamed into place: a reader never sees part of it.
        tmp = f"{path}.{os.urandom(4).hex()}.part"
        try:
            with open(tmp, "wb") as file:
                file.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def get(self, key: str, limit: int) -> bytes | None:
        try:
            with open(os.path.join(self.root, key), "rb") as file:
                return file.read(limit + 1)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def list_keys(self, prefix: str) -> list[str]:
        directory = os.path.join(self.root, prefix)
        return [prefix + e.name for e in _scandir(directory) if e.is_file(follow_symlinks=False)]

    def delete_keys(self, keys: Sequence[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.root, key))

    def delete(self, batch: Sequence[StoredObject]) -> list[StoredObject]:
        deleted = []
        for obj in batch:
            try:
                os.unlink(os.path.join(self.root, obj.key))
            except FileNotFoundError:
                pass  # someone else deleted it: gone all the same
            except OSError as exc:
                logger.warning("gc: could not delete %s: %s", obj.key, exc.strerror)
                continue
            deleted.append(obj)
        return deleted


def _sorts_before(prefix: str, start_after: str | None) -> bool:
    """Whether every key under ``prefix`` sorts at or before ``start_after``."""
    return start_after is not None and start_after[: len(prefix)] > prefix


def _epoch_ns(when: datetime) -> int:
    return (when - _EPOCH) // timedelta(microseconds=1) * 1000


class S3Chunks:
    """Chunk objects in an S3 bucket: ListObjectsV2 pages, DeleteObjects batches."""

    def __init__(self, client: Any, bucket: str, endpoint: str | None, keys: KeyPattern) -> None:
        self._client = client
        self.bucket = bucket
        self.endpoint = endpoint
        self.keys = keys

    def describe(self) -> str:
        return f"s3 bucket {self.bucket} at {self.endpoint or '<aws default>'}"

    def selecting(self, namespaces: Sequence[str]) -> S3Chunks:
        return S3Chunks(self._client, self.bucket, self.endpoint, KeyPattern(self.keys.prefix, namespaces))

    def scan(self, start_after: str | None = None) -> Iterator[StoredObject]:
        paginator = self._client.get_paginator("list_objects_v2")
        for prefix in sorted(self.keys.list_prefixes()):
            if _sorts_before(prefix, start_after):
                continue
            after = {"StartAfter": start_after} if start_after is not None and start_after > prefix else {}
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, **after):
                for item in page.get("Contents", ()):
                    parsed = self.keys.parse(item["Key"])
                    if parsed is None or parsed[1]:
                        continue  # not a chunk (S3 writes are whole-object PUTs: no partial files)
                    yield StoredObject(item["Key"], parsed[0], item["Size"], _epoch_ns(item["LastModified"]))

    def delete(self, batch: Sequence[StoredObject]) -> list[StoredObject]:
        from nixl_backends.s3_endpoint import delete_objects  # loaded already: open_chunks imported it

        errors = delete_objects(self._client, self.bucket, [obj.key for obj in batch])
        for key, code in errors.items():
            logger.warning("gc: could not delete s3://%s/%s: %s", self.bucket, key, code)
        return [obj for obj in batch if obj.key not in errors]

    def put(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def get(self, key: str, limit: int) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            response = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{limit}")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        with contextlib.closing(response["Body"]) as body:
            return body.read(limit + 1)

    def list_keys(self, prefix: str) -> list[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        return [item["Key"] for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix)
                for item in page.get("Contents", ())]  # fmt: skip

    def delete_keys(self, keys: Sequence[str]) -> None:
        from nixl_backends.s3_endpoint import delete_objects

        for key, code in delete_objects(self._client, self.bucket, list(keys)).items():
            logger.warning("could not delete s3://%s/%s: %s", self.bucket, key, code)


def open_chunks(store_config: Any, key_prefix: str, namespaces: Sequence[str] | None = None,
                connections: int = 2) -> ChunkObjects:  # fmt: skip
    """The chunk objects of a parsed store section (:func:`~nixl_backends.registry.parse_store_config`).

    ``namespaces`` None: every namespace under ``key_prefix``. S3 credentials
    come from the section or, without keys there, the AWS credential chain.
    ``connections``: the most S3 requests in flight at once (callers' threads).
    """
    keys = KeyPattern(key_prefix, namespaces)
    from nixl_backends.dualblade import DualBladeStoreConfig
    from nixl_backends.tiered import TieredStoreConfig

    if isinstance(store_config, TieredStoreConfig):
        store_config = store_config.tier_configs[-1]  # the shared tier; the local ones bound themselves
    if isinstance(store_config, DualBladeStoreConfig):
        raise GcError(f"a dualblade tier bounds itself (store.capacity_bytes, evicting by its ranker): "
                      f"nothing to collect under {store_config.root}")
    if isinstance(store_config, PosixStoreConfig):
        return PosixChunks(store_config.root, keys)
    # Imported here: collecting a POSIX root needs no boto3.
    from nixl_backends.s3_endpoint import S3StoreConfig, s3_client, s3_session
    from nixl_backends.s3agg import S3AggStoreConfig

    if isinstance(store_config, S3AggStoreConfig):
        store_config = store_config.s3_config  # the gateway only reads; its bucket holds the chunks
    if not isinstance(store_config, S3StoreConfig):
        raise TypeError(f"not a store config: {type(store_config).__name__}")
    client = s3_client(store_config, s3_session(store_config), max_pool_connections=connections)
    return S3Chunks(client, store_config.bucket, store_config.endpoint, keys)


@dataclass
class Tally:
    objects: int = 0
    bytes: int = 0

    def add(self, obj: StoredObject) -> None:
        self.objects += 1
        self.bytes += obj.size


@dataclass
class GcReport:
    dry_run: bool
    before: Tally = field(default_factory=Tally)
    before_by_namespace: dict[str, Tally] = field(default_factory=dict)
    deleted: Tally = field(default_factory=Tally)
    # Listed in the second pass (the store may have changed since the first).
    listed: Tally = field(default_factory=Tally)
    partial_deleted: Tally = field(default_factory=Tally)
    failed: int = 0

    @property
    def after(self) -> Tally:
        return Tally(self.listed.objects - self.deleted.objects, self.listed.bytes - self.deleted.bytes)


def run_gc(
    chunks: ChunkObjects,
    policy: GcPolicy,
    *,
    dry_run: bool = False,
    now_ns: int | None = None,
    on_selected: Callable[[StoredObject], None] | None = None,
    on_deleted: Callable[[list[StoredObject]], None] | None = None,
) -> GcReport:
    """One collection: list, plan the cutoff, list again and delete (or, dry, only select).

    ``on_selected`` sees every object chosen, in listing order, before it is deleted;
    ``on_deleted`` every batch of chunks actually deleted (never in a dry run), e.g.
    to write the removal records engines announce (:mod:`nixl_backends.removals`).
    """
    now_ns = time.time_ns() if now_ns is None else now_ns
    report = GcReport(dry_run)
    used, sizes = array("q"), array("q")
    for obj in chunks.scan():
        if obj.partial:
            continue
        used.append(obj.used_ns)
        sizes.append(obj.size)
        report.before.add(obj)
        report.before_by_namespace.setdefault(obj.namespace, Tally()).add(obj)
    cutoff = plan_cutoff(
        np.frombuffer(used, dtype=np.int64), np.frombuffer(sizes, dtype=np.int64), policy, now_ns
    )
    selection = Selection(cutoff, now_ns - int(policy.partial_max_age_s * _NS_PER_S))

    batch: list[StoredObject] = []

    def flush() -> None:
        done = batch if dry_run else chunks.delete(batch)
        report.failed += len(batch) - len(done)
        for obj in done:
            (report.partial_deleted if obj.partial else report.deleted).add(obj)
        batch.clear()
        deleted_chunks = [obj for obj in done if not obj.partial]
        if on_deleted is not None and not dry_run and deleted_chunks:
            on_deleted(deleted_chunks)

    for obj in chunks.scan():
        if not obj.partial:
            report.listed.add(obj)
        if not selection.takes(obj):
            continue
        if on_selected is not None:
            on_selected(obj)
        batch.append(obj)
        if len(batch) == DELETE_BATCH:
            flush()
    flush()
    logger.info(
        "gc %s: %d of %d chunk objects (%d of %d bytes) %s",
        chunks.describe(),
        report.deleted.objects,
        report.before.objects,
        report.deleted.bytes,
        report.before.bytes,
        "selected (dry run)" if dry_run else "deleted",
    )
    return report
