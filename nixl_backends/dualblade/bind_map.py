"""The bind map: chunk key -> extent of the tier's extent file, kept in a journal that survives restarts.

The extent file is an array of equal extents (one stored object, padded to
4 KiB), so the paper's LBA map invariants hold by construction: every extent
is aligned, extents are disjoint, and a chunk is contiguous inside its
extent. Free extents are handed out lowest first, so the chunks of one write
(one prompt's consecutive chunks) land next to each other and a later read of
that prompt is one sequential sweep.

The journal is append-only text, one record a line with its own checksum:
``["E", epoch]`` first (a fresh id whenever the file is started anew),
then ``["B", key, extent, xxh3]`` binds and ``["F", key]`` frees. A record is
appended (and fsynced) only after what it promises is true: a bind after the
chunk's bytes are durable in the extent, a free before the extent is reused.
So a crash at any point leaves a journal whose every bind names an extent
holding exactly that chunk's bytes, and a torn last line (the crash hit the
append) fails its checksum and is dropped. The object checksum in a bind lets
a reader reject bytes that changed on disk after all.

Processes that only look chunks up (vLLM's scheduler half) share the writer's
journal and tail it; the writer compacts it into a snapshot of live binds
once it grows, renamed over the old file under a new epoch (readers compare
the first line's epoch on every refresh: an inode number may be reused).
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

logger = logging.getLogger(__name__)

# Compact once the journal holds this many times more records than live binds (and at least _MIN_COMPACT).
_COMPACT_FACTOR, _MIN_COMPACT = 4, 1024


@dataclass(frozen=True)
class Binding:
    extent: int
    checksum: int  # xxh3-64 of the stored object


def _line(record: list) -> bytes:
    payload = json.dumps(record, separators=(",", ":"))
    return f"{payload}\t{xxhash.xxh3_64_hexdigest(payload.encode())}\n".encode()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _parse(line: bytes) -> list | None:
    """A record, or None for a line that is torn or not ours."""
    try:
        payload, check = line.decode().rstrip("\n").rsplit("\t", 1)
        if xxhash.xxh3_64_hexdigest(payload.encode()) != check:
            return None
        record = json.loads(payload)
    except (UnicodeDecodeError, ValueError):
        return None
    if isinstance(record, list) and len(record) == 4 and record[0] == "B" and isinstance(record[1], str) \
            and isinstance(record[2], int) and isinstance(record[3], int):
        return record
    if isinstance(record, list) and len(record) == 2 and record[0] in ("F", "E") and isinstance(record[1], str):
        return record
    return None


def _epoch_line() -> bytes:
    return _line(["E", uuid.uuid4().hex])


class BindMap:
    """Bindings and free extents of one extent file, replayed from and recorded in its journal.

    Not thread-safe: the store serialises calls. ``writer=False`` opens it for
    lookups only (no appends; :meth:`refresh` follows the writer's journal).
    """

    def __init__(self, journal_path: str, num_extents: int, writer: bool) -> None:
        self.journal_path = journal_path
        self.num_extents = num_extents
        self.writer = writer
        self.bindings: dict[str, Binding] = {}
        self._records = 0
        self._offset = 0
        self._epoch: str | None = None
        self.refresh()
        bound = {b.extent for b in self.bindings.values()}
        self._free = [e for e in range(num_extents) if e not in bound]
        heapq.heapify(self._free)
        self._fd: int | None = None
        if writer:
            self._fd = os.open(journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            # Appends after a torn tail would never be read: cut it off first.
            os.ftruncate(self._fd, self._offset)
            if self._offset == 0:  # a new journal, or nothing in it survived: start an epoch
                self._append_lines(_epoch_line(), 1)
                self.refresh()

    # -- replay --------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Apply records appended since the last call (a journal under a new epoch is read from the start)."""
        try:
            with open(self.journal_path, "rb") as journal:
                first = _parse(journal.readline())
                # A journal the writer started always opens with its epoch; one without is replayed as it is.
                epoch = first[1] if first is not None and first[0] == "E" else ""
                if epoch != self._epoch:
                    self.bindings.clear()
                    self._records = self._offset = 0
                    self._epoch = epoch
                journal.seek(self._offset)
                data = journal.read()
        except FileNotFoundError:
            return
        for line in data.splitlines(keepends=True):
            # An unterminated last line may still be being appended (or was torn by a crash).
            record = _parse(line) if line.endswith(b"\n") else None
            if record is None:
                if line.endswith(b"\n"):
                    logger.warning("dualblade: journal %s has a bad record at byte %d; it and later records "
                                   "are dropped", self.journal_path, self._offset)
                break
            self._apply(record)
            self._offset += len(line)

    def _apply(self, record: list) -> None:
        self._records += 1
        if record[0] == "E":
            return
        if record[0] == "B" and 0 <= record[2] < self.num_extents:
            self.bindings[record[1]] = Binding(record[2], record[3])
        else:
            # A free, or a bind beyond a shrunk extent file (a smaller capacity): the chunk is gone.
            self.bindings.pop(record[1], None)

    # -- the writer ----------------------------------------------------------------------------

    @property
    def free_extents(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free extents, lowest first; fewer when fewer are free."""
        return [heapq.heappop(self._free) for _ in range(min(count, len(self._free)))]

    def release(self, extents: Iterable[int]) -> None:
        """Return extents that were allocated but never bound, or whose chunk was unbound."""
        for extent in extents:
            heapq.heappush(self._free, extent)

    def bind(self, entries: Iterable[tuple[str, Binding]]) -> None:
        """Record binds; their chunks' bytes must already be durable in their extents."""
        entries = list(entries)
        self._append([["B", key, b.extent, b.checksum] for key, b in entries])
        for key, binding in entries:
            self.bindings[key] = binding
        self._maybe_compact()

    def unbind(self, keys: Iterable[str]) -> list[int]:
        """Record frees (durably, before anyone reuses the extents); returns the extents now unbound."""
        keys = [key for key in dict.fromkeys(keys) if key in self.bindings]
        self._append([["F", key] for key in keys])
        extents = [self.bindings.pop(key).extent for key in keys]
        self._maybe_compact()
        return extents

    def _append(self, records: list[list]) -> None:
        if records:
            self._append_lines(b"".join(_line(record) for record in records), len(records))

    def _append_lines(self, data: bytes, count: int) -> None:
        if self._fd is None:
            raise RuntimeError("bind map opened for lookups only")
        _write_all(self._fd, data)
        os.fsync(self._fd)
        self._offset += len(data)
        self._records += count

    def _maybe_compact(self) -> None:
        # After the bindings changed: the snapshot must hold the state the records just appended describe.
        if self._records > max(_MIN_COMPACT, _COMPACT_FACTOR * len(self.bindings)):
            self._compact()

    def _compact(self) -> None:
        """Rewrite the journal as a new epoch with the live binds only: a new file renamed over the old one."""
        temp = f"{self.journal_path}.compact"
        epoch = _epoch_line()
        data = epoch + b"".join(_line(["B", key, b.extent, b.checksum]) for key, b in self.bindings.items())
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, self.journal_path)
        directory = os.open(os.path.dirname(os.path.abspath(self.journal_path)), os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        os.close(self._fd)
        self._fd = None  # a failed reopen must not leave a number the next open() may reuse
        self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND)
        self._epoch = _parse(epoch)[1]
        self._offset, self._records = len(data), len(self.bindings) + 1
        logger.debug("dualblade: journal compacted to %d binds", len(self.bindings))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
