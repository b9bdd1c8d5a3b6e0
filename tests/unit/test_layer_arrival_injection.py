"""Layer arrival end to end without a device: a store that delivers per layer, the read path that verifies
each layer and hands the hit on after layer 0, and the forward's injection that waits for each layer.

- ``HitReader.read_arriving`` over a fake ``KVStore`` whose ``read_layerwise``
  copies stored objects into the pool slots (chunk-major) layer by layer, as the
  s3agg gateway delivers them;
- ``LayerwiseInjection`` over a small CPU KV cache, its layers landed from
  another thread as the forward reaches them, on the CPU path and on the copy
  stream path (``InlineCopyStream`` standing in for a CUDA stream).

The pool is a real ``HostBufferPool`` (its double-release check included);
this tier has no NIXL, so a fake agent accepts its memory registration.
Expected KV bytes are cut out of the stored objects by the layout arithmetic
here, not by the code under test.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dualpath_connector.load.arrivals import LayerArrivals
from dualpath_connector.cache.copy_stream import InlineCopyStream
from dualpath_connector.load.inject import Injector, LayerwiseInjection
from dualpath_connector.lanes.io_lanes import IOLane
from dualpath_connector.cache.kv_cache_view import KVCacheView
from dualpath_connector.metadata import ChunkLoad, LoadSpec
from dualpath_connector.protocol import StoreKeySpace
from dualpath_connector.load.loaded_hit import LoadedHit, RemoteBuffer
from dualpath_connector.load.fetch import HitReader
from dualpath_connector.metrics.stats_recorder import StatsRecorder
from dualpath_dev import kv_layouts
from dualpath_dev.kv_layouts import CacheShape
from nixl_backends.buffers import HostBufferPool
from nixl_backends.integrity import ChunkIntegrity
from nixl_backends.layout import KVNamespace, chunk_hashes
from nixl_backends.s3agg_protocol import LAYOUT_CHUNK_MAJOR
from nixl_backends.store import KVStore

LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM, BPC = 4, 12, 4, 1, 8, 2
SHAPE = CacheShape(LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM)
OUTER = 2  # flash_attention: K and V apart
BLOCK_BYTES = BLOCK * HEADS * DIM * 2  # bf16
NAMESPACE = KVNamespace(model="m", dtype="bfloat16", block_size=BLOCK, chunk_tokens=BLOCK * BPC, num_layers=LAYERS,
                        num_kv_heads=HEADS, head_size=DIM, kv_layout="NHD",
                        layer_block_bytes=OUTER * BLOCK_BYTES * BPC)  # fmt: skip
KEY_SPACE = StoreKeySpace.of(NAMESPACE, "t")
LAYOUT = KEY_SPACE.layout
HASHES = chunk_hashes(KEY_SPACE.digest, list(range(3 * BLOCK * BPC)), BLOCK * BPC)
# Three chunks; blocks out of order, and the last chunk's first sub-block held by the local prefix cache.
CHUNKS = [ChunkLoad(HASHES[0], 0, [5, 1]), ChunkLoad(HASHES[1], 0, [9, 3]), ChunkLoad(HASHES[2], 1, [7])]
POOL_SLOTS = 8
# Long enough never to expire in a passing test; what must not wait is asserted far below it.
PATIENT_S = 10.0


class FakeAgent:
    """What HostBufferPool asks of a NIXL agent (this tier has none)."""

    def register_memory(self, descs, mem_type):
        return object()

    def deregister_memory(self, registration) -> None:
        pass


def _stored_object(index: int) -> np.ndarray:
    """Chunk ``index``'s stored object: finite bf16 KV (the reader refuses NaN/inf) and its sealed trailer."""
    values = torch.randn(LAYOUT.full_block_bytes // 2, generator=torch.Generator().manual_seed(index)).bfloat16()
    obj = np.zeros(LAYOUT.object_bytes, dtype=np.uint8)
    obj[: LAYOUT.full_block_bytes] = values.view(torch.uint8).numpy()
    ChunkIntegrity(LAYOUT).seal(HASHES[index], obj)
    return obj


OBJECTS = [_stored_object(i) for i in range(len(HASHES))]


def _expected(obj: np.ndarray, layer: int, sub_block: int) -> torch.Tensor:
    """Sub-block ``sub_block`` of layer ``layer`` of a stored object, as a cache block holds it: [outer, bytes]."""
    start = layer * LAYOUT.layer_block_bytes + sub_block * OUTER * BLOCK_BYTES
    return torch.from_numpy(obj[start : start + OUTER * BLOCK_BYTES].copy()).view(OUTER, BLOCK_BYTES)


def _cache_block(view: KVCacheView, layer: int, block: int) -> torch.Tensor:
    return view.layers[layer][:, block]


def _holds(view: KVCacheView, chunk: ChunkLoad, obj: np.ndarray, layer: int) -> bool:
    """Every block of ``chunk`` holds ``obj``'s bytes in ``layer``."""
    return all(
        torch.equal(_cache_block(view, layer, block), _expected(obj, layer, chunk.first_sub_block + i))
        for i, block in enumerate(chunk.block_ids)
    )


def _untouched(view: KVCacheView, before: list[torch.Tensor], chunk: ChunkLoad, layer: int) -> bool:
    return all(torch.equal(_cache_block(view, layer, b), before[layer][:, b]) for b in chunk.block_ids)


class LayerwiseStore(KVStore):
    """Stored objects by key, delivered per layer into chunk-major pool slots as the s3agg gateway does."""

    delivers_layers = True

    def __init__(self, pool: HostBufferPool) -> None:
        super().__init__(LAYOUT)
        self.pool = pool
        self.objects = {KEY_SPACE.key(h): obj.copy() for h, obj in zip(HASHES, OBJECTS)}
        self.deleted: list[str] = []
        self.whole_reads: list[list[str]] = []
        self.layerwise_calls: list[dict] = []
        self.events: list[str] = []
        self.fail_at_layer: int | None = None  # raise instead of delivering this layer
        # Before delivering layer l >= 1, wait for this (the forward waits for layer l), if set.
        self.pace: list[threading.Event] | None = None

    def _slot(self, addr: int) -> int:
        return (addr - self.pool.base_addr) // self.pool.slot_stride

    def lookup(self, keys):
        return next((i for i, key in enumerate(keys) if key not in self.objects), len(keys))

    def read(self, keys, dst_addrs):
        self.whole_reads.append(list(keys))
        for key, addr in zip(keys, dst_addrs):
            if key in self.objects:
                self.pool.slot_view(self._slot(addr))[:] = self.objects[key]
        return [key in self.objects for key in keys]

    def write(self, keys, src_addrs):
        raise AssertionError("the read path never writes")

    def delete(self, keys):
        self.deleted.extend(keys)

    def read_layerwise(self, keys, regions, on_layer, *, layout, compute_window_s):
        self.layerwise_calls.append({"keys": list(keys), "layout": layout, "compute_window_s": compute_window_s})
        for layer in range(LAYOUT.num_layers):
            if self.pace is not None and layer > 0:
                assert self.pace[layer].wait(PATIENT_S), f"the forward never waited for layer {layer}"
            if layer == self.fail_at_layer:
                raise RuntimeError(f"gateway died before layer {layer}")
            for key, addr in zip(keys, regions):
                slot = self.pool.slot_view(self._slot(addr))
                for part in (slice(*LAYOUT.layer_range(layer)), slice(*LAYOUT.digest_range(layer))):
                    slot[part] = self.objects[key][part]
            self.events.append(f"layer {layer}")
            on_layer(layer)


@pytest.fixture
def pool() -> HostBufferPool:
    made = HostBufferPool(FakeAgent(), LAYOUT.object_bytes, POOL_SLOTS)
    yield made
    made.close()


@pytest.fixture
def store(pool) -> LayerwiseStore:
    return LayerwiseStore(pool)


@pytest.fixture
def reader(pool, store):
    lane = IOLane("test-read", None)
    made = HitReader(store=store, pool=pool, block_size=BLOCK, key_space=KEY_SPACE, integrity=ChunkIntegrity(LAYOUT),
                     kv_dtype=torch.bfloat16, peers=None, lane=lane, stats=StatsRecorder(), de_read_timeout_s=1.0,
                     cores=None, layer_arrival=True, compute_window_s=lambda: 0.0125)  # fmt: skip
    yield made
    made.shutdown()
    assert lane.stop(PATIENT_S)


def _spec(req_id: str = "r1") -> LoadSpec:
    return LoadSpec(req_id, list(CHUNKS))


class Reported:
    """What ``on_read`` got, and what the hit's arrivals said at that moment."""

    def __init__(self, store: LayerwiseStore) -> None:
        self.store = store
        self.hits: list[LoadedHit] = []
        self.layer0_good: list[int] = []
        self.done = threading.Event()

    def __call__(self, hit: LoadedHit) -> None:
        self.store.events.append("on_read")
        self.hits.append(hit)
        if hit.arrivals is not None:
            self.layer0_good.append(hit.arrivals.wait(0, 0.0))
        self.done.set()


def _corrupt_digest(store: LayerwiseStore, index: int, layer: int) -> None:
    store.objects[KEY_SPACE.key(HASHES[index])][LAYOUT.digest_range(layer)[0]] ^= 0x01


# -- the read path: HitReader.read_arriving ----------------------------------------------------


def test_the_hit_is_handed_on_once_right_after_layer_0_verified(reader, store, pool):
    reported = Reported(store)
    reader.read_arriving(_spec(), reported)
    assert store.events == ["layer 0", "on_read", "layer 1", "layer 2", "layer 3"]
    (hit,) = reported.hits
    assert hit.chunks == CHUNKS and len(hit.slots) == len(CHUNKS) and reported.layer0_good == [3]
    assert store.whole_reads == [] and store.deleted == []
    # The store was asked for chunk-major delivery into the slots, with the measured window.
    (call,) = store.layerwise_calls
    assert call["layout"] == LAYOUT_CHUNK_MAJOR and call["compute_window_s"] == 0.0125
    assert call["keys"] == [KEY_SPACE.key(h) for h in HASHES]
    assert hit.arrivals.complete(len(CHUNKS))
    for slot, obj in zip(hit.slots, OBJECTS):
        assert np.array_equal(pool.slot_view(slot), obj)
    # The read ended: releasing returns the slots at once.
    reader.release([hit])
    assert pool.free_slots == POOL_SLOTS


def test_the_compute_window_is_read_per_read(reader, store):
    windows = iter([None, 0.5])
    reader.compute_window_s = lambda: next(windows)
    for req_id in ("r1", "r2"):
        reported = Reported(store)
        reader.read_arriving(_spec(req_id), reported)
        reader.release(reported.hits)
    assert [c["compute_window_s"] for c in store.layerwise_calls] == [None, 0.5]


def test_a_bad_layer_0_digest_shortens_the_hit_and_deletes_the_chunk(reader, store, pool):
    _corrupt_digest(store, 1, 0)
    reported = Reported(store)
    reader.read_arriving(_spec(), reported)
    (hit,) = reported.hits
    assert hit.chunks == CHUNKS[:1] and reported.layer0_good == [1]
    assert store.deleted == [KEY_SPACE.key(HASHES[1])]
    # Later layers are checked only for the chunks still in the hit.
    assert [hit.arrivals.wait(layer, 0.0) for layer in range(LAYERS)] == [1, 1, 1, 1]
    assert hit.arrivals.complete(1) and reader.stats.take()["corrupt_chunks"] == 1
    reader.release([hit])
    assert pool.free_slots == POOL_SLOTS


def test_a_bad_later_layer_fails_only_from_that_layer(reader, store):
    _corrupt_digest(store, 1, 2)
    reported = Reported(store)
    reader.read_arriving(_spec(), reported)
    (hit,) = reported.hits
    # Reported with every chunk (layer 0 was fine); layer 2 says only chunk 0 is good, and so does layer 3.
    assert hit.chunks == CHUNKS and reported.layer0_good == [3]
    assert [hit.arrivals.wait(layer, 0.0) for layer in range(LAYERS)] == [3, 3, 1, 1]
    assert store.deleted == [KEY_SPACE.key(HASHES[1])]
    assert not hit.arrivals.complete(len(CHUNKS))
    reader.release([hit])


def test_no_good_chunk_at_layer_0_reports_an_empty_hit_and_frees_the_slots_when_the_read_ends(reader, store, pool):
    _corrupt_digest(store, 0, 0)
    reported = Reported(store)
    reader.read_arriving(_spec(), reported)
    (hit,) = reported.hits
    assert hit.chunks == [] and hit.slots == []
    # Released by the read path itself once the read ended; a second release (the worker's) is harmless.
    assert pool.free_slots == POOL_SLOTS
    reader.release([hit])
    assert pool.free_slots == POOL_SLOTS


def test_a_store_failing_before_layer_0_falls_back_to_whole_object_reads(reader, store, pool):
    store.fail_at_layer = 0
    reported = Reported(store)
    reader.read_arriving(_spec(), reported)
    (hit,) = reported.hits
    assert hit.arrivals is None and hit.chunks == CHUNKS
    assert store.whole_reads == [[KEY_SPACE.key(h) for h in HASHES]]
    for slot, obj in zip(hit.slots, OBJECTS):
        assert np.array_equal(pool.slot_view(slot), obj)
    # Only the fallback's slots are held: the layerwise read's went back.
    assert pool.free_slots == POOL_SLOTS - len(CHUNKS)
    reader.release([hit])
    assert pool.free_slots == POOL_SLOTS


def test_a_store_failing_after_layer_0_ends_the_arrivals_and_reports_nothing_more(reader, store, pool):
    store.fail_at_layer = 2
    reported = Reported(store)
    reader.read_arriving(_spec(), reported)
    (hit,) = reported.hits  # once, at layer 0; not again for the failure
    assert hit.chunks == CHUNKS and store.whole_reads == []
    started = time.monotonic()
    assert [hit.arrivals.wait(layer, PATIENT_S) for layer in range(LAYERS)] == [3, 3, 0, 0]
    assert time.monotonic() - started < 5.0  # ended: nobody waits for the missing layers
    reader.release([hit])
    assert pool.free_slots == POOL_SLOTS


@pytest.mark.parametrize("delivers_layers", [True, False])
def test_submit_here_reads_layerwise_only_from_a_store_that_delivers_layers(pool, store, delivers_layers):
    store.delivers_layers = delivers_layers
    lane = IOLane("test-read", None)
    reader = HitReader(store=store, pool=pool, block_size=BLOCK, key_space=KEY_SPACE,
                       integrity=ChunkIntegrity(LAYOUT), kv_dtype=torch.bfloat16, peers=None, lane=lane,
                       stats=StatsRecorder(), de_read_timeout_s=1.0, cores=None, layer_arrival=True)  # fmt: skip
    try:
        reported = Reported(store)
        reader.submit_here(_spec(), reported)
        assert reported.done.wait(PATIENT_S)
        (hit,) = reported.hits
        assert hit.chunks == CHUNKS and (hit.arrivals is not None) == delivers_layers
        assert (len(store.layerwise_calls), len(store.whole_reads)) == ((1, 0) if delivers_layers else (0, 1))
        reader.release([hit])
    finally:
        reader.shutdown()
        assert lane.stop(PATIENT_S)


# -- the forward: LayerwiseInjection of arriving hits ------------------------------------------


class Forward:
    """A CPU KV cache, an Injector over the pool, and the calls the injector made to the worker."""

    def __init__(self, pool: HostBufferPool, path: str, release=None, arrival_timeout_s: float = PATIENT_S) -> None:
        self.view = KVCacheView(kv_layouts.make_caches("flash_attention", SHAPE, seed=7), NUM_BLOCKS)
        assert self.view.outer == OUTER and self.view.layer_block_bytes(BPC) == LAYOUT.layer_block_bytes
        self.before = [layer.clone() for layer in self.view.layers]
        self.failed: list[tuple[int, list[str]]] = []
        self.released: list[LoadedHit] = []
        self.injector = Injector(
            view=self.view, pool=pool, blocks_per_chunk=BPC, agent=None, stats=StatsRecorder(),
            repair=self._no_repair, release=release or self.released.extend, transfer_timeout_s=1.0,
            fail=self._fail, arrival_timeout_s=arrival_timeout_s,
            load_stream=InlineCopyStream() if path == "copy-stream" else None,
        )  # fmt: skip

    def _fail(self, hit: LoadedHit, good: int) -> None:
        # What the worker reports to vLLM: the blocks of chunks ``good..`` as the hit holds them now.
        self.failed.append((good, [c.chunk_hash for c in hit.chunks[good:]]))

    @staticmethod
    def _no_repair(hit: LoadedHit) -> None:
        raise AssertionError("no hit here is read from a DE")

    def run(self, hits: list[LoadedHit]) -> LayerwiseInjection:
        """One forward: each layer's injection right before its attention."""
        injection = LayerwiseInjection(self.injector, hits)
        for layer in range(LAYERS):
            injection.layer(layer)
        injection.finish()
        return injection


def _arriving_hit(pool: HostBufferPool) -> LoadedHit:
    return LoadedHit("r1", list(CHUNKS), slots=pool.acquire(len(CHUNKS)), arrivals=LayerArrivals(LAYERS))


def _put_layer(pool: HostBufferPool, hit: LoadedHit, layer: int) -> None:
    """What the store writes for ``layer``: every chunk's Layer Block and digest (bad chunks' too)."""
    for slot, obj in zip(hit.slots, OBJECTS):
        for part in (slice(*LAYOUT.layer_range(layer)), slice(*LAYOUT.digest_range(layer))):
            pool.slot_view(slot)[part] = obj[part]


def _watch_waits(
    hit: LoadedHit, waiting: list[threading.Event] | None = None
) -> tuple[list[int], list[threading.Event]]:
    """The layers the forward waited for, in order, and per layer an Event set once it is waiting for it."""
    waited: list[int] = []
    waiting = waiting or [threading.Event() for _ in range(LAYERS)]
    real_wait = hit.arrivals.wait

    def wait(layer: int, timeout_s: float) -> int:
        waited.append(layer)
        waiting[layer].set()
        return real_wait(layer, timeout_s)

    hit.arrivals.wait = wait
    return waited, waiting


def _feeder(pool, hit, waiting: list[threading.Event], good: list[int | None]) -> threading.Thread:
    """The read lane: lands layer ``l`` (``good[l]`` chunks) only once the forward waits for it, so a forward
    that did not wait would inject the pool's zeros; ``None`` ends the read with an error instead."""

    def run() -> None:
        for layer in range(1, LAYERS):
            if not waiting[layer].wait(PATIENT_S):
                return
            if good[layer] is None:
                hit.arrivals.end("boom")
                return
            _put_layer(pool, hit, layer)
            hit.arrivals.land(layer, good[layer])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


PATHS = ["cpu", "copy-stream"]


@pytest.mark.parametrize("path", PATHS)
def test_layers_landing_as_the_forward_reaches_them_are_injected_byte_exact(pool, path):
    forward = Forward(pool, path)
    hit = _arriving_hit(pool)
    # Reported once layer 0 landed (the read path's contract); the rest land while the forward runs.
    _put_layer(pool, hit, 0)
    hit.arrivals.land(0, len(CHUNKS))
    waited, waiting = _watch_waits(hit)
    feeder = _feeder(pool, hit, waiting, [None, 3, 3, 3])
    injection = forward.run([hit])
    feeder.join(PATIENT_S)
    assert injection.arriving == [hit] and injection.local == [] and waited == [0, 1, 2, 3]
    for layer in range(LAYERS):
        for chunk, obj in zip(CHUNKS, OBJECTS):
            assert _holds(forward.view, chunk, obj, layer)
    # Only the hit's blocks changed.
    hit_blocks = {b for c in CHUNKS for b in c.block_ids}
    others = [b for b in range(NUM_BLOCKS) if b not in hit_blocks]
    assert all(torch.equal(forward.view.layers[l][:, others], forward.before[l][:, others]) for l in range(LAYERS))
    # Negative control: the comparison tells one chunk's bytes from another's.
    assert not _holds(forward.view, CHUNKS[0], OBJECTS[1], 0)
    assert forward.failed == [] and forward.released == [hit]


@pytest.mark.parametrize("path", PATHS)
def test_a_layer_with_fewer_good_chunks_fails_them_and_injects_only_the_good_ones_after(pool, path):
    forward = Forward(pool, path)
    hit = _arriving_hit(pool)
    _put_layer(pool, hit, 0)
    hit.arrivals.land(0, 3)
    waited, waiting = _watch_waits(hit)
    feeder = _feeder(pool, hit, waiting, [None, 3, 1, 1])
    forward.run([hit])
    feeder.join(PATIENT_S)
    assert forward.failed == [(1, [HASHES[1], HASHES[2]])] and waited == [0, 1, 2, 3]
    # Chunk 0 is whole; the failed chunks got the layers before the bad one and nothing from it on
    # (vLLM recomputes their blocks), even though the pool holds their bytes.
    for layer in range(LAYERS):
        assert _holds(forward.view, CHUNKS[0], OBJECTS[0], layer)
    for chunk, obj in zip(CHUNKS[1:], OBJECTS[1:]):
        assert _holds(forward.view, chunk, obj, 0) and _holds(forward.view, chunk, obj, 1)
        for layer in (2, 3):
            assert _untouched(forward.view, forward.before, chunk, layer)
            assert not _holds(forward.view, chunk, obj, layer)  # negative control: the pool's bytes differ
    assert forward.released == [hit]


@pytest.mark.parametrize("path", PATHS)
def test_a_read_that_ends_early_fails_the_hit_at_once(pool, path):
    forward = Forward(pool, path, arrival_timeout_s=600.0)
    hit = _arriving_hit(pool)
    _put_layer(pool, hit, 0)
    hit.arrivals.land(0, 3)
    waited, waiting = _watch_waits(hit)
    feeder = _feeder(pool, hit, waiting, [None, None, 3, 3])
    started = time.monotonic()
    forward.run([hit])
    assert time.monotonic() - started < 5.0
    feeder.join(PATIENT_S)
    assert forward.failed == [(0, HASHES[:3])]
    assert waited == [0, 1]  # nothing waited for after the failure
    for chunk, obj in zip(CHUNKS, OBJECTS):
        assert _holds(forward.view, chunk, obj, 0)
        assert all(_untouched(forward.view, forward.before, chunk, layer) for layer in range(1, LAYERS))
    assert forward.released == [hit]


@pytest.mark.parametrize("path", PATHS)
def test_a_hit_whose_layers_are_all_in_is_injected_without_waiting(pool, path):
    forward = Forward(pool, path)
    hit = _arriving_hit(pool)
    for layer in range(LAYERS):
        _put_layer(pool, hit, layer)
        hit.arrivals.land(layer, 3)
    injection = forward.run([hit])
    assert injection.arriving == [] and injection.local == [hit]
    assert all(_holds(forward.view, c, o, l) for c, o in zip(CHUNKS, OBJECTS) for l in range(LAYERS))
    assert forward.failed == [] and forward.released == [hit]


@pytest.mark.parametrize("abandoned", [False, True], ids=["ended", "abandoned"])
def test_slots_of_a_hit_released_before_its_read_ended_return_only_when_it_ends(pool, reader, abandoned):
    forward = Forward(pool, "cpu", release=reader.release)
    hit = _arriving_hit(pool)
    for layer in range(LAYERS):
        _put_layer(pool, hit, layer)
        hit.arrivals.land(layer, 3)
    forward.run([hit])
    # The forward is done and released the hit; the store may still write (the read has not ended).
    assert hit.slots == [] and pool.free_slots == POOL_SLOTS - len(CHUNKS)
    if abandoned:
        hit.arrivals.end("timed out", abandoned=True)
    else:
        hit.arrivals.end()
    # Abandoned: NIXL may still write them, so they come back only once its transfers ended.
    assert pool.free_slots == POOL_SLOTS - (len(CHUNKS) if abandoned else 0)
    hit.arrivals.transfers_ended()
    assert pool.free_slots == POOL_SLOTS


def test_reader_and_forward_together_put_the_stored_kv_in_the_cache(reader, store, pool):
    """The store delivers layer l (on the read lane) only once the forward waits for it."""
    waiting = [threading.Event() for _ in range(LAYERS)]
    store.pace = waiting
    reported = Reported(store)
    reader.submit_here(_spec(), reported)
    assert reported.done.wait(PATIENT_S)
    (hit,) = reported.hits
    assert not hit.arrivals.complete(len(CHUNKS))  # layer 1 is held back until the forward gets there
    waited, _ = _watch_waits(hit, waiting)
    forward = Forward(pool, "cpu", release=reader.release)
    forward.run([hit])
    for layer in range(LAYERS):
        for chunk, obj in zip(CHUNKS, OBJECTS):
            assert _holds(forward.view, chunk, obj, layer)
    assert forward.failed == [] and waited == [0, 1, 2, 3]
    assert store.events == ["layer 0", "on_read", "layer 1", "layer 2", "layer 3"]
    # The read ends on the lane after its last layer; then the slots are back.
    reader.lane.run_now(lambda: None)
    assert pool.free_slots == POOL_SLOTS


class HeldStore(LayerwiseStore):
    """Whole reads only, each held until ``hold`` is set (a store slower than the repair's deadline)."""

    delivers_layers = False

    def __init__(self, pool: HostBufferPool) -> None:
        super().__init__(pool)
        self.hold = threading.Event()

    def read(self, keys, dst_addrs):
        assert self.hold.wait(PATIENT_S)
        return super().read(keys, dst_addrs)


@pytest.mark.parametrize("store_late", [True, False], ids=["store-late", "store-in-time"])
def test_a_repair_waits_at_most_its_deadline_and_a_late_read_frees_its_slots(pool, store_late):
    """A DE's READ failed mid-forward: the forward reads the hit from the store, within the deadline a READ had.
    Past it the step fails (never waits without end), and the read ending later gives its slots back."""
    store = HeldStore(pool)
    lane = IOLane("test-read", None)
    reader = HitReader(store=store, pool=pool, block_size=BLOCK, key_space=KEY_SPACE, integrity=ChunkIntegrity(LAYOUT),
                       kv_dtype=torch.bfloat16, peers=None, lane=lane, stats=StatsRecorder(), de_read_timeout_s=1.0,
                       cores=None, repair_timeout_s=0.5)  # fmt: skip
    # The DE's lease already ended: no READ of its buffer is trusted, so the hit is read here.
    remote = RemoteBuffer("10.0.0.2:5700", None, "lease-1", [0] * len(CHUNKS), 0, time.monotonic() - 1.0)
    hit = LoadedHit("r1", list(CHUNKS), remote=remote)
    if not store_late:
        store.hold.set()
    outcome: list[object] = []
    forward = threading.Thread(target=lambda: outcome.append(_call(reader.repair, hit)))
    forward.start()
    forward.join(PATIENT_S)
    assert not forward.is_alive(), "the forward still waits for the repair"
    try:
        if store_late:
            assert isinstance(outcome[0], RuntimeError)
            assert str(outcome[0]) == "request r1: hit KV lost with its DE and not read from the store in 0.5 s"
            assert hit.slots == []
            store.hold.set()
        else:
            assert outcome == [None] and len(hit.slots) == len(CHUNKS)
            reader.release([hit])
        assert lane.run_now(lambda: None, PATIENT_S)  # the held read has ended by now
        assert pool.free_slots == POOL_SLOTS
    finally:
        store.hold.set()
        reader.shutdown()
        assert lane.stop(PATIENT_S)


def _call(function, *args) -> object:
    try:
        return function(*args)
    except Exception as exc:  # what the forward would see
        return exc
