"""The worker's store read path refuses a chunk before it can reach a KV cache: bad digest, NaN/inf values.

A fake store (this tier has no NIXL) hands the read path stored objects, as
``KVStore.read`` would into a chunk-major load pool and ``read_segments`` into a
layer-major one; the checks, the shortened hit, the counter and the deletion are
the real ``HitReader``'s.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from dualpath_connector.lanes.io_lanes import IOLane
from dualpath_connector.load.verify import leading_run
from dualpath_connector.protocol import StoreKeySpace
from dualpath_connector.load.fetch import HitReader
from dualpath_connector.metrics.stats_recorder import StatsRecorder
from nixl_backends.buffers import HostBufferPool
from nixl_backends.integrity import ChunkIntegrity
from nixl_backends.layout import KVNamespace, chunk_hashes
from tests.unit.test_layer_arrival_injection import FakeAgent

NAMESPACE = KVNamespace(model="m", dtype="bfloat16", block_size=4, chunk_tokens=4, num_layers=2, num_kv_heads=1,
                        head_size=8, kv_layout="NHD", layer_block_bytes=2 * 4 * 8 * 2)  # fmt: skip
KEY_SPACE = StoreKeySpace.of(NAMESPACE, "t")
LAYOUT = KEY_SPACE.layout
HASHES = chunk_hashes(KEY_SPACE.digest, list(range(16)), 4)


def _memory(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class FakeStore:
    """Objects by key; ``read`` copies them to the addresses (one run each), ``read_segments`` into the pieces."""

    def __init__(self, layer_major: bool) -> None:
        self.reads_segments = layer_major
        self.objects: dict[str, np.ndarray] = {}
        self.deleted: list[str] = []

    def read(self, keys, dst_addrs):
        return self.read_segments(keys, [np.array([[addr, LAYOUT.object_bytes]]) for addr in dst_addrs])

    def read_segments(self, keys, segments):
        for key, pieces in zip(keys, segments):
            if key in self.objects:
                at = 0
                for addr, nbytes in pieces.tolist():
                    _memory(addr, nbytes)[:] = self.objects[key][at : at + nbytes]
                    at += nbytes
        return [key in self.objects for key in keys]

    def delete(self, keys):
        self.deleted.extend(keys)


def _kv_values(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.full_block_bytes // 2, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.fixture(params=["chunk-major", "layer-major"])
def reader(request):
    """A real HostBufferPool (registered with a fake agent) in both layouts: the checks read the object in pieces."""
    layer_major = request.param == "layer-major"
    pool = HostBufferPool(FakeAgent(), LAYOUT.object_bytes, len(HASHES),
                          (LAYOUT.num_layers, LAYOUT.layer_block_bytes) if layer_major else None)  # fmt: skip
    store = FakeStore(layer_major)
    integrity = ChunkIntegrity(LAYOUT)
    for i, chunk_hash in enumerate(HASHES):
        obj = np.zeros(LAYOUT.object_bytes, dtype=np.uint8)
        obj[: LAYOUT.full_block_bytes] = _kv_values(i).view(torch.uint8).numpy()
        integrity.seal(chunk_hash, obj)
        store.objects[KEY_SPACE.key(chunk_hash)] = obj
    lane = IOLane("test-read", None)
    made = HitReader(store=store, pool=pool, block_size=4, key_space=KEY_SPACE, integrity=integrity,
                     kv_dtype=torch.bfloat16, peers=None, lane=lane, stats=StatsRecorder(), de_read_timeout_s=1.0,
                     cores=None)  # fmt: skip
    yield made, store, integrity
    made.shutdown()
    pool.close()


def _forge(store: FakeStore, integrity: ChunkIntegrity, index: int, values: torch.Tensor) -> None:
    """What a writer who can compute the checksum could store: valid digests over ``values``."""
    obj = store.objects[KEY_SPACE.key(HASHES[index])].copy()
    obj[: LAYOUT.full_block_bytes] = values.view(torch.uint8).numpy()
    integrity.seal(HASHES[index], obj)
    store.objects[KEY_SPACE.key(HASHES[index])] = obj


def test_sound_chunks_are_all_readable(reader):
    hit_reader, store, _ = reader
    assert hit_reader._store_read(HASHES, list(range(len(HASHES)))) == [True] * len(HASHES)
    assert store.deleted == [] and hit_reader.stats.take()["corrupt_chunks"] == 0


def test_a_flipped_byte_ends_the_hit_counts_and_deletes_the_chunk(reader):
    hit_reader, store, _ = reader
    store.objects[KEY_SPACE.key(HASHES[2])][5] ^= 0x10
    ok = hit_reader._store_read(HASHES, list(range(len(HASHES))))
    assert leading_run(ok) == 2
    assert store.deleted == [KEY_SPACE.key(HASHES[2])]
    assert hit_reader.stats.take()["corrupt_chunks"] == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
# In the first layer, and the very last value of the Full Block (the last layer's): the whole chunk is checked.
@pytest.mark.parametrize("position", [3, LAYOUT.full_block_bytes // 2 - 1], ids=["first-layer", "last-value"])
def test_non_finite_kv_under_valid_digests_is_refused(reader, bad, position):
    hit_reader, store, integrity = reader
    values = _kv_values(9)
    values[position] = bad
    _forge(store, integrity, 1, values)
    ok = hit_reader._store_read(HASHES, list(range(len(HASHES))))
    assert leading_run(ok) == 1 and store.deleted == [KEY_SPACE.key(HASHES[1])]
    # Negative control: finite forged values pass every check (only the keyed mode stops those).
    _forge(store, integrity, 1, _kv_values(9))
    assert hit_reader._store_read(HASHES, list(range(len(HASHES)))) == [True] * len(HASHES)
