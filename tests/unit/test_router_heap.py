"""The router's heap trimming (dualpath_router.heap): glibc's malloc_trim where there is one, a no-op elsewhere."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest

from dualpath_router.heap import HeapTrimmer


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_this_process_trims_and_gives_freed_memory_back():
    trimmer = HeapTrimmer.of_this_process()
    assert trimmer.available
    # 64 MiB in small blocks (below the mmap threshold: they come from the arena), then a block after them
    # (so free() cannot hand them back by shrinking the heap's top), then the 64 MiB freed.
    blocks = [ctypes.create_string_buffer(16 << 10) for _ in range(4096)]
    pin = ctypes.create_string_buffer(16 << 10)
    del blocks
    assert trimmer.trim()  # the freed blocks were still held by malloc
    del pin
    assert (trimmer.trims, trimmer.released) == (1, 1)


def test_without_malloc_trim_nothing_is_called_and_nothing_fails():
    trimmer = HeapTrimmer(None)
    assert not trimmer.available and trimmer.trim() is False and trimmer.trims == 0


def test_a_trim_that_released_nothing_is_counted_as_such():
    calls = []
    trimmer = HeapTrimmer(lambda pad: calls.append(pad) or 0)
    assert trimmer.trim() is False and calls == [0] and (trimmer.trims, trimmer.released) == (1, 0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
@pytest.mark.parametrize("environment, capped", [({}, "True"), ({"MALLOC_ARENA_MAX": "4"}, "False")])
def test_the_arena_cap_is_set_unless_the_operator_set_one(environment, capped):
    # In a process of its own: a cap cannot be taken back, and this one's arenas are the suite's.
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | environment
    out = subprocess.run([sys.executable, "-c", "from dualpath_router.heap import limit_malloc_arenas as cap; "
                          "print(cap())"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == capped
