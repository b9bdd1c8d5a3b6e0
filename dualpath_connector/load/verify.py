"""Whether the bytes a read landed may reach a KV cache: the load path's one check.

A load is planned (:mod:`plan`), fetched (:mod:`fetch`), verified
here and injected (:mod:`inject`). An object's digests (its integrity
trailer) are checked, then its values for NaN/inf; a chunk that fails either is
a miss, never KV: the hit ends before it, and it is deleted from the store so
the next lookup misses it and the next save stores it again.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from nixl_backends.buffers import HostBufferPool
from nixl_backends.integrity import ChunkIntegrity
from nixl_backends.layout import DIGEST_BYTES
from nixl_backends.store import KVStore

from dualpath_connector.protocol import StoreKeySpace
from dualpath_connector.metrics.stats_recorder import StatsRecorder

logger = logging.getLogger(__name__)

# KV dtypes whose values are checked for NaN/inf after the digest (on CPU, see HitVerifier._problem).
_FINITE_CHECKED = (torch.float16, torch.bfloat16, torch.float32)


def leading_run(ok: list[bool]) -> int:
    """How many chunks from the first are readable: the hit ends at the first bad chunk; later chunks are not
    used even if they arrived, so the loaded prefix stays contiguous."""
    return next((i for i, flag in enumerate(ok) if not flag), len(ok))


class HitVerifier:
    """Checks objects in load-pool slots, whole (``whole``) or one layer at a time as they arrive (``layer``)."""

    def __init__(self, *, store: KVStore, pool: HostBufferPool, key_space: StoreKeySpace, integrity: ChunkIntegrity,
                 kv_dtype: torch.dtype, stats: StatsRecorder) -> None:  # fmt: skip
        self.store = store
        self.pool = pool
        self.key_space = key_space
        self.integrity = integrity
        self.kv_dtype = kv_dtype if kv_dtype in _FINITE_CHECKED else None
        self.stats = stats

    def whole(self, chunk_hashes: list[str], slots: list[int], ok: list[bool]) -> list[bool]:
        """``ok`` (what the store read) with the first chunk of its leading run that fails its checks set False.

        Only the leading run is used, so verification stops at its end or at the first bad chunk.
        """
        started = time.perf_counter()
        ok = list(ok)
        for i in range(leading_run(ok)):
            problem = self._problem(chunk_hashes[i], slots[i])
            if problem is not None:
                self._drop_corrupt(self.key_space.key(chunk_hashes[i]), problem)
                ok[i] = False
                break
        self.stats.sample("verify_seconds", time.perf_counter() - started)
        return ok

    def layer(self, chunk_hashes: list[str], slots: list[int], layer: int, limit: int) -> int:
        """How many of the first ``limit`` chunks' ``layer`` verify; a bad one is dropped from the store."""
        started = time.perf_counter()
        good = limit
        for i in range(limit):
            problem = self._problem(chunk_hashes[i], slots[i], layer)
            if problem is not None:
                self._drop_corrupt(self.key_space.key(chunk_hashes[i]), problem)
                good = i
                break
        self.stats.sample("verify_seconds", time.perf_counter() - started)
        return good

    def _object_parts(self, slot: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The Layer Blocks and the trailer of the object in a load-pool slot (in one run, or layer-major)."""
        layout = self.key_space.layout
        if self.pool.layer_major:
            return [self.pool.layer_view(slot, layer) for layer in range(layout.num_layers)], self.pool.trailer_view(slot)
        obj = self.pool.slot_view(slot)
        return [obj[slice(*layout.layer_range(layer))] for layer in range(layout.num_layers)], obj[layout.full_block_bytes :]

    def _problem(self, chunk_hash: str, slot: int, layer: int | None = None) -> str | None:
        """Why the object in ``slot`` (or its layer ``layer`` alone) must not reach a KV cache, or None."""
        chunk_hash = self.key_space.object_hash(chunk_hash)
        layers, trailer = self._object_parts(slot)
        if layer is None:
            intact = self.integrity.verify_parts(chunk_hash, layers, trailer)
        else:
            digest = trailer[layer * DIGEST_BYTES : (layer + 1) * DIGEST_BYTES]
            intact = self.integrity.verify_layer(chunk_hash, layer, layers[layer], digest)
        if layer is not None:
            layers = [layers[layer]]
        elif not self.pool.layer_major:
            # A chunk-major Full Block is one run: one scan for NaN/inf, not one per layer.
            layers = [self.pool.slot_view(slot)[: self.key_space.layout.full_block_bytes]]
        if not intact:
            return f"failed its integrity check ({self.integrity.algorithm})"
        if self.kv_dtype is not None:
            # A writer who can compute the digest (checksum mode) could store
            # NaN/inf; in a KV cache they spread to whichever request reuses
            # the blocks, so they are refused too.
            for data in layers:
                values = torch.from_numpy(data).view(self.kv_dtype)
                # aminmax propagates NaN and returns an inf it meets: one pass, two
                # scalars. isfinite(...).all() makes several tensors the size of
                # the chunk (abs, compares, a bool mask) and is ~20x slower.
                low, high = torch.aminmax(values)
                if not (math.isfinite(low.item()) and math.isfinite(high.item())):
                    return "holds non-finite values"
        return None

    def _drop_corrupt(self, key: str, problem: str) -> None:
        # Deleted, so the next lookup misses it and the next save stores it
        # again; left in place it would stay "present" and fail every load.
        logger.warning("store chunk %s %s: treated as a miss and deleted", key, problem)
        self.stats.add(corrupt_chunks=1)
        try:
            self.store.delete([key])
        except Exception as exc:
            logger.warning("could not delete corrupt chunk %s: %s", key, exc)
