"""The extent file: where the tier's chunks live, opened twice (page-cache path and direct path).

A regular file is preallocated to the tier's capacity, so every extent has
its blocks before the first write (a disk too small fails at start-up, not
mid-save). A raw block device may stand in for the file (the
paper's NVMe namespace): no file system at all under the direct path.

The same bytes are reachable through two descriptors: a buffered one (the
page-cache path, Group 1) and an ``O_DIRECT`` one (the NVMe-direct path,
Group 2). Linux keeps the two coherent: a direct write drops the cached pages
it overwrites, a direct read first writes back dirty pages of its range. So a
re-plan that moves a layer from one path to the other needs no data movement.

Freeing an extent is the TRIM of the paper: a hole punched in the file
(``fallocate(PUNCH_HOLE)``) or ``BLKDISCARD`` on a device, so the SSD learns
that the blocks hold nothing. A punched extent's blocks are allocated again by
the next write into it (a file system that is full by then fails that save,
which is a miss, never a wrong byte); extents reused at once by an eviction
are not punched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import stat
import struct

from nixl_backends.buffers import align_down
from nixl_backends.configuration import ConfigError

logger = logging.getLogger(__name__)

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_BLKDISCARD, _BLKGETSIZE64 = 0x1277, 0x80081272
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


class ExtentFile:
    """``capacity`` bytes of extents in a preallocated file or on a block device, with both descriptors."""

    def __init__(self, path: str, capacity: int, device: bool = False) -> None:
        self.path = path
        self.is_device = os.path.exists(path) and stat.S_ISBLK(os.stat(path).st_mode)
        if device and not self.is_device:
            # A typo must not become a file of `capacity` bytes under /dev (often a tmpfs: memory).
            raise ConfigError(f"store.device {path!r} is not a block device")
        self.buffered_fd = os.open(path, os.O_RDWR | (0 if self.is_device else os.O_CREAT), 0o644)
        try:
            if self.is_device:
                size = struct.unpack("Q", fcntl.ioctl(self.buffered_fd, _BLKGETSIZE64, b"\0" * 8))[0]
                self.capacity = min(capacity, align_down(size))
            else:
                self.capacity = capacity
                # Blocks for every extent now (a full disk fails here, at start-up, not mid-save).
                os.posix_fallocate(self.buffered_fd, 0, capacity)
                if os.fstat(self.buffered_fd).st_size > capacity:
                    os.ftruncate(self.buffered_fd, capacity)
            # The page-cache path reads exact ranges; readahead would pull the neighbouring direct-path
            # layers into the page cache too, filling the budget with bytes that are read direct anyway.
            os.posix_fadvise(self.buffered_fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.direct_fd = self._open_direct(path)
        except BaseException:
            os.close(self.buffered_fd)
            raise

    @staticmethod
    def _open_direct(path: str) -> int | None:
        try:
            return os.open(path, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # tmpfs and some network file systems refuse O_DIRECT: everything takes the page-cache path.
            logger.warning("dualblade: %s does not support O_DIRECT; the direct path is off", path)
            return None

    def sync(self) -> None:
        """Make written bytes durable (both descriptors share the inode, so one fdatasync covers both)."""
        os.fdatasync(self.buffered_fd)

    def discard(self, offset: int, length: int) -> None:
        """Tell the device ``[offset, offset+length)`` holds nothing (a hint: failures are logged, not raised)."""
        if self.is_device:
            try:
                fcntl.ioctl(self.buffered_fd, _BLKDISCARD, struct.pack("QQ", offset, length))
            except OSError as exc:
                logger.debug("dualblade: BLKDISCARD failed on %s: %s", self.path, exc)
            return
        if _libc.fallocate(self.buffered_fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            logger.debug("dualblade: punching a hole in %s failed: %s", self.path, os.strerror(ctypes.get_errno()))

    def drop_cached(self, offset: int, length: int) -> None:
        """Drop ``[offset, offset+length)`` from the page cache (its layers moved to the direct path)."""
        os.posix_fadvise(self.buffered_fd, offset, length, os.POSIX_FADV_DONTNEED)

    def allocated_bytes(self) -> int:
        """Bytes the file system holds for the file (falls as holes are punched); the capacity for a device."""
        return self.capacity if self.is_device else os.fstat(self.buffered_fd).st_blocks * 512

    def close(self) -> None:
        for fd in (self.buffered_fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None
