"""A host buffer pool registered with NIXL once.

Registration is slow for many small regions, so the pool is one large,
page-aligned region registered at start-up and carved into fixed-size slots
(one stored object each). Requests borrow slots; nothing is registered per request.
Every slot starts on a page boundary (the stride is rounded up to 4 KiB), so a
store may move a slot's aligned interior with O_DIRECT (the Dual-Blade tier).

A pool is *chunk-major* (slot ``j`` holds one stored object in one run) or
*layer-major* (``layer_major=(num_layers, layer_block_bytes)``): layer ``l`` of
every slot lies in one band, ``[l][slot][Layer Block]``, and each slot's
trailer in a band after the last layer. A hit read into consecutive slots
then holds each layer as one host run, moved to a GPU by one copy per layer
(large enough for mma_preload) instead of one per chunk. A slot's object is
then in ``num_layers + 1`` pieces (:meth:`HostBufferPool.slot_segments`), which a
store that scatters (``KVStore.reads_segments``) reads into directly.
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
    """``num_slots`` slots of ``slot_bytes`` in one NIXL-registered DRAM region, chunk- or layer-major."""

    def __init__(self, agent, slot_bytes: int, num_slots: int, layer_major: tuple[int, int] | None = None) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"slot_bytes and num_slots must be positive, got {slot_bytes}, {num_slots}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.layer_major = layer_major is not None
        if layer_major is None:
            # Slot i spans [i*stride, i*stride + slot_bytes); the padding after it is never used.
            self.slot_stride = align_up(slot_bytes)
            self.num_layers, self.layer_bytes = 1, self.slot_stride
            self.layer_stride = 0  # one piece per slot
            self.trailer_bytes, self.trailer_offset = 0, 0
            total = self.slot_stride * num_slots
        else:
            self.num_layers, self.layer_bytes = layer_major
            self.trailer_bytes = slot_bytes - self.num_layers * self.layer_bytes
            if self.layer_bytes <= 0 or self.trailer_bytes < 0:
                raise ValueError(f"layer-major slots of {slot_bytes} bytes cannot hold {layer_major}")
            # Slot i's layer l at l*layer_stride + i*layer_bytes; its trailer at trailer_offset + i*trailer_bytes.
            self.slot_stride = self.layer_bytes
            self.layer_stride = self.layer_bytes * num_slots
            self.trailer_offset = align_up(self.layer_stride * self.num_layers)
            total = self.trailer_offset + self.trailer_bytes * num_slots
        raw = np.zeros(total + ALIGNMENT, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGNMENT
        self._raw = raw  # owns the memory; `array` is an aligned view of it
        self.array = raw[start : start + total]
        self.base_addr = self.array.ctypes.data
        self._agent = agent
        self._registration = agent.register_memory([(self.base_addr, self.array.nbytes, 0, "")], "DRAM")
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        logger.info("host buffer pool: %d slots x %d bytes (%s) registered with NIXL", num_slots, slot_bytes,
                    "layer-major" if self.layer_major else "chunk-major")  # fmt: skip

    def acquire(self, count: int) -> list[int]:
        """Borrow ``count`` slots at once, or raise :class:`PoolExhausted` (never blocks).

        Layer-major: the lowest run of ``count`` consecutive free slots where one
        exists (each layer of the hit is then one host run), else any free slots.
        """
        if count < 0:
            raise ValueError(f"cannot acquire {count} slots")
        with self._lock:
            if count > len(self._free):
                raise PoolExhausted(f"need {count} slots, {len(self._free)} of {self.num_slots} free")
            if self.layer_major and count > 1:
                run = _consecutive_run(self._free, count)
                if run is not None:
                    taken = set(run)
                    self._free = [slot for slot in self._free if slot not in taken]
                    return run
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
        """Where the slot starts: its object (chunk-major) or its layer 0 (layer-major; layer l is
        ``l * layer_stride`` further)."""
        return self.base_addr + slot * self.slot_stride

    def slot_view(self, slot: int) -> np.ndarray:
        """The slot's object in one run (chunk-major pools only)."""
        if self.layer_major:
            raise ValueError("a layer-major slot is in pieces: use layer_view / trailer_view / slot_segments")
        start = slot * self.slot_stride
        return self.array[start : start + self.slot_bytes]

    def layer_view(self, slot: int, layer: int) -> np.ndarray:
        """Layer ``layer`` of the slot's object (layer-major pools)."""
        start = layer * self.layer_stride + slot * self.layer_bytes
        return self.array[start : start + self.layer_bytes]

    def trailer_addr(self, slot: int) -> int:
        """Where the slot's trailer starts (layer-major pools)."""
        return self.base_addr + self.trailer_offset + slot * self.trailer_bytes

    def trailer_view(self, slot: int) -> np.ndarray:
        """The slot's object bytes after its layers (layer-major pools)."""
        start = self.trailer_offset + slot * self.trailer_bytes
        return self.array[start : start + self.trailer_bytes]

    def slot_segments(self, slot: int) -> np.ndarray:
        """Where the slot's object goes, in object byte order: ``k x 2`` rows ``(addr, length)``."""
        if not self.layer_major:
            return np.array([[self.slot_addr(slot), self.slot_bytes]], dtype=np.uint64)
        rows = np.empty((self.num_layers + 1, 2), dtype=np.uint64)
        rows[:-1, 0] = self.slot_addr(slot) + np.arange(self.num_layers, dtype=np.uint64) * np.uint64(self.layer_stride)
        rows[:-1, 1] = self.layer_bytes
        rows[-1] = (self.trailer_addr(slot), self.trailer_bytes)
        return rows[rows[:, 1] > 0]

    def close(self) -> None:
        if self._registration is not None:
            self._agent.deregister_memory(self._registration)
            self._registration = None


def _consecutive_run(free: list[int], count: int) -> list[int] | None:
    """The lowest ``count`` consecutive slot numbers all in ``free``, or None."""
    ordered = np.sort(np.asarray(free, dtype=np.int64))
    # ordered[i + count - 1] - ordered[i] == count - 1: count distinct consecutive numbers start at ordered[i].
    starts = np.flatnonzero(ordered[count - 1 :] - ordered[: len(ordered) - count + 1] == count - 1)
    if not len(starts):
        return None
    first = int(ordered[starts[0]])
    return list(range(first, first + count))
