"""Giving the router's freed heap back to the operating system.

The router allocates on many threads (the event loop; worker threads that
tokenize prompts and look hits up; the tokenizer's native code), and glibc's
malloc keeps what they free in per-thread arenas instead of returning it. In
the hostile soak that kept the router's RSS climbing while its Python heap
stayed flat (tracemalloc: 1.2 to 5.6 MiB traced over 15 minutes, 470k objects
throughout), and one ``malloc_trim(0)`` in the running router released 15 MB.
So the router trims every ``heap_trim_interval_s``: a few milliseconds on a
worker thread, never on the event loop. And before it starts any thread it
caps glibc at :data:`MALLOC_ARENAS` arenas (``mallopt(M_ARENA_MAX)``, what
``MALLOC_ARENA_MAX`` sets from the environment): its threads mostly wait on the
network, and an arena each (glibc's default, up to 8 per core) keeps what each
freed apart from the others, where nothing else can reuse it.

Elsewhere than glibc (musl, macOS) there is no ``malloc_trim``; trimming is
then off, and says so once in the log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Arenas the router's threads share (glibc's M_ARENA_MAX).
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc at ``arenas`` arenas (call before threads start); False where there is no mallopt.

    ``MALLOC_ARENA_MAX`` in the environment, set by whoever runs the router, is left as it is (False).
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_ARENA_MAX, arenas))


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """``trim()`` returns free heap pages of every malloc arena to the OS (glibc); elsewhere a no-op."""

    def __init__(self, malloc_trim: Callable[[int], int] | None) -> None:
        self._malloc_trim = malloc_trim
        if malloc_trim is None:
            logger.info("no malloc_trim in this C library: the router's freed heap is not trimmed")
        self.trims = 0
        self.released = 0  # trims that gave memory back

    @classmethod
    def of_this_process(cls) -> HeapTrimmer:
        return cls(_glibc_malloc_trim())

    @property
    def available(self) -> bool:
        return self._malloc_trim is not None

    def trim(self) -> bool:
        """Whether this trim gave memory back."""
        if self._malloc_trim is None:
            return False
        released = bool(self._malloc_trim(0))
        self.trims += 1
        self.released += released
        return released
