"""A host buffer pool registered with NIXL once.

Registration is slow for many small regions, so the pool is one large,
page-aligned region registered at start-up and carved into fixed-size slots
(one stored object each). Requests borrow slots; nothing is registered per request.
Every slot starts on a page boundary (the stride is rounded up to 4 KiB), so a
store may move a slot's aligned interior with O_DIRECT (the Dual-Blade tier).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

logger = logging.getLogger(__name__)

# Page alignment keeps the region usable for O_DIRECT paths (covers 512 B and 4 KiB logical blocks).
ALIGNMENT = 4096


def align_up(value: int) -> int:
    return -(-value // ALIGNMENT) * ALIGNMENT


def align_down(value: int) -> int:
    return value // ALIGNMENT * ALIGNMENT


class PoolExhausted(RuntimeError):
    """Not enough free slots; callers shorten or skip the transfer instead of waiting."""


class HostBufferPool:
    """``num_slots`` slots of ``slot_bytes`` in one NIXL-registered DRAM region."""

    def __init__(self, agent, slot_bytes: int, num_slots: int) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"slot_bytes and num_slots must be positive, got {slot_bytes}, {num_slots}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        # Slot i spans [i*stride, i*stride + slot_bytes); the padding after it is never used.
        self.slot_stride = align_up(slot_bytes)
        raw = np.zeros(self.slot_stride * num_slots + ALIGNMENT, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGNMENT
        self._raw = raw  # owns the memory; `array` is an aligned view of it
        self.array = raw[start : start + self.slot_stride * num_slots]
        self.base_addr = self.array.ctypes.data
        self._agent = agent
        self._registration = agent.register_memory([(self.base_addr, self.array.nbytes, 0, "")], "DRAM")
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        logger.info("host buffer pool: %d slots x %d bytes registered with NIXL", num_slots, slot_bytes)

    def acquire(self, count: int) -> list[int]:
        """Borrow ``count`` slots at once, or raise :class:`PoolExhausted` (never blocks)."""
        if count < 0:
            raise ValueError(f"cannot acquire {count} slots")
        with self._lock:
            if count > len(self._free):
                raise PoolExhausted(f"need {count} slots, {len(self._free)} of {self.num_slots} free")
            taken = self._free[-count:] if count else []
            del self._free[len(self._free) - count :]
        return taken

    def release(self, slots: list[int]) -> None:
        with self._lock:
            # A slot freed twice would later be handed to two borrowers at once.
            if len(set(slots)) != len(slots) or not set(slots).isdisjoint(self._free):
                raise ValueError(f"releasing slots that are already free: {sorted(slots)}")
            self._free.extend(slots)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def slot_addr(self, slot: int) -> int:
        return self.base_addr + slot * self.slot_stride

    def slot_view(self, slot: int) -> np.ndarray:
        start = slot * self.slot_stride
        return self.array[start : start + self.slot_bytes]

    def close(self) -> None:
        if self._registration is not None:
            self._agent.deregister_memory(self._registration)
            self._registration = None
