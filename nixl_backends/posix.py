"""POSIX backend: Full Blocks as files under a root directory, moved by NIXL's POSIX plugin.

The root may be local disk or a mounted shared file system (3FS, NFS,
Lustre). Files are written under a temporary name and renamed into place, so
a reader never sees a half-written chunk under its final name. Each file is
one chunk object (:attr:`BlockLayout.object_bytes`: the Full Block and its
integrity trailer); a successful read refreshes its mtime, the "last used"
time that ``dualpath-kv gc`` evicts by.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from nixl_backends.configuration import ConfigError
from nixl_backends.layout import BlockLayout
from nixl_backends.nixl_io import TransferAbandoned, descriptors, run_nixl_transfers
from nixl_backends.store import KVStore

logger = logging.getLogger(__name__)

# NIXL POSIX plugin parameters per io_engine (also used by s3agg-gateway's posix backing).
IO_ENGINE_PARAMS = {
    "aio": {"use_aio": "true"},
    "uring": {"use_uring": "true"},
    "posix_aio": {"use_posix_aio": "true"},
}


def create_posix_backend(agent: Any, io_engine: str) -> None:
    """The agent's one POSIX backend; a second store on the same agent (a tier) shares the first's."""
    if "POSIX" not in agent.backends:
        agent.create_backend("POSIX", IO_ENGINE_PARAMS[io_engine])


@dataclass
class PosixStoreConfig:
    """``{"backend": "posix", ...}``."""

    # Where the chunks live relative to the engine (vLLM KV events' locality): its own disks. A root on a file
    # system all engines mount (3FS, Lustre, NFS) is REMOTE: say so with the connector's kv_events_locality.
    locality: ClassVar[str] = "LOCAL"

    root: str
    io_engine: Literal["aio", "uring", "posix_aio"] = "aio"
    io_timeout_s: float = 30.0

    def validate(self) -> None:
        if not self.root:
            raise ConfigError("store.root must name a directory")
        if self.io_timeout_s <= 0:
            raise ConfigError(f"store.io_timeout_s must be positive, got {self.io_timeout_s}")


class PosixStore(KVStore):
    reads_segments = True  # one descriptor per piece, file offsets in object order

    def __init__(self, config: PosixStoreConfig, layout: BlockLayout, agent=None) -> None:
        super().__init__(layout)
        self.config = config
        self.root = os.path.abspath(config.root)
        os.makedirs(self.root, exist_ok=True)
        self._agent = agent
        if agent is not None:
            create_posix_backend(agent, config.io_engine)

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def lookup(self, keys: Sequence[str]) -> int:
        expected = self.layout.object_bytes
        for count, key in enumerate(keys):
            try:
                if os.stat(self.path(key)).st_size != expected:
                    return count
            except FileNotFoundError:
                return count
        return len(keys)

    def _transfer_files(self, op: str, fds: list[int | None], pieces: Sequence[np.ndarray]) -> list[bool]:
        """One NIXL request per file: its object to or from ``pieces[i]`` (``k x 2`` rows (addr, length))."""
        size = self.layout.object_bytes
        live = [i for i, fd in enumerate(fds) if fd is not None]
        ok = [False] * len(fds)
        if not live:
            return ok
        registration = self._agent.register_memory([(0, size, fds[i], "") for i in live], "FILE")
        transfers = []
        for i in live:
            addrs, lengths = pieces[i][:, 0], pieces[i][:, 1]
            offsets = np.cumsum(lengths) - lengths  # each piece's place in the file
            transfers.append((descriptors(addrs, lengths), descriptors(offsets, lengths, fds[i])))
        try:
            results = run_nixl_transfers(self._agent, op, transfers, "FILE", self.config.io_timeout_s)
        except TransferAbandoned as exc:
            exc.when_ended(lambda: self._agent.deregister_memory(registration))
            raise
        self._agent.deregister_memory(registration)
        for i, result in zip(live, results):
            ok[i] = result
        return ok

    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        size = self.layout.object_bytes
        return self.read_segments(keys, [np.array([[addr, size]], dtype=np.uint64) for addr in dst_addrs])

    def read_segments(self, keys: Sequence[str], segments: Sequence[np.ndarray]) -> list[bool]:
        if self._agent is None:
            raise RuntimeError("PosixStore was opened without a NIXL agent: lookup only")
        fds: list[int | None] = []
        for key in keys:
            try:
                fds.append(os.open(self.path(key), os.O_RDONLY))
            except OSError:
                fds.append(None)
        try:
            # NIXL reports a file shorter than the object as a failed read.
            ok = self._transfer_files("READ", fds, segments)
            self._mark_used(fds, ok)
        except TransferAbandoned as exc:
            exc.when_ended(lambda: self._close(fds))  # NIXL may still use these descriptors until then
            raise
        except BaseException:
            self._close(fds)
            raise
        self._close(fds)
        return ok

    @staticmethod
    def _mark_used(fds: list[int | None], ok: list[bool]) -> None:
        # A read refreshes the file's mtime: the chunk is immutable, so mtime
        # means "last used", which `dualpath-kv gc` evicts by (atime is often
        # not kept: noatime, relatime).
        for fd, read in zip(fds, ok):
            if read:
                with contextlib.suppress(OSError):
                    os.utime(fd)

    @staticmethod
    def _close(fds: list[int | None]) -> None:
        for fd in fds:
            if fd is not None:
                os.close(fd)

    def _discard(self, fds: list[int | None], temps: dict[int, str]) -> None:
        """Close a failed write's descriptors and remove its temporary files."""
        self._close(fds)
        for path in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def delete(self, keys: Sequence[str]) -> None:
        # An unlink leaves a reader that has the file open its bytes; later opens miss.
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(key))

    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        if self._agent is None:
            raise RuntimeError("PosixStore was opened without a NIXL agent: lookup only")
        # A complete file stays; a truncated one (a crash, a full disk) is replaced.
        done = [self.lookup([key]) == 1 for key in keys]
        todo = [i for i, present in enumerate(done) if not present]
        temps: dict[int, str] = {}
        fds: list[int | None] = []
        try:
            for i in todo:
                final = self.path(keys[i])
                os.makedirs(os.path.dirname(final), exist_ok=True)
                temps[i] = f"{final}.{uuid.uuid4().hex}.tmp"
                fds.append(os.open(temps[i], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
            size = self.layout.object_bytes
            results = self._transfer_files("WRITE", fds, [np.array([[src_addrs[i], size]], dtype=np.uint64) for i in todo])
        except TransferAbandoned as exc:
            exc.when_ended(lambda: self._discard(fds, temps))  # NIXL may still write through these descriptors
            raise
        except BaseException:
            self._discard(fds, temps)
            raise
        for fd, result in zip(fds, results):
            if result:
                # Durable before it is visible under its final name.
                os.fsync(fd)
        self._close(fds)
        for i, result in zip(todo, results):
            if result:
                os.replace(temps[i], self.path(keys[i]))
                done[i] = True
            else:
                os.unlink(temps[i])
                logger.warning("posix store: write of %s failed", keys[i])
        return done
