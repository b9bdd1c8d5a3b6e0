"""DeviceCopier's copy plans on CPU tensors, every layout, with InlineCopyStream standing in for a CUDA stream.

Without a GPU the stream/event ordering cannot run here (``scripts/gpu_connector_check.py``
checks it on one); what runs is everything else: batching over staging, the per-slot
copies and the device-side scatter and gather, checked byte for byte against the blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualpath_connector.cache.copy_stream import InlineCopyStream
from dualpath_connector.cache.device_copies import DeviceCopier
from dualpath_connector.cache.kv_cache_view import KVCacheView
from tests.unit.test_kv_cache_view import LAYERS, LAYOUTS, NUM_BLOCKS, _caches, _host, _trailers_untouched

BPC = 2
# Blocks out of order and a chunk whose first block is not loaded (a local prefix hit).
SLOTS, SUBS = [2, 2, 0, 0, 1], [0, 1, 0, 1, 1]
OUT_BLOCKS, IN_BLOCKS = [5, 2, 7, 0, 3], [1, 6, 3, 4, 0]


@pytest.mark.parametrize("staging_slots", [1, 3])  # one slot per batch, and all at once
@pytest.mark.parametrize("layout", LAYOUTS)
def test_saves_then_loads_move_the_planned_blocks_byte_exact(layout, staging_slots):
    source, target = KVCacheView(_caches(layout, 11), NUM_BLOCKS), KVCacheView(_caches(layout, 12), NUM_BLOCKS)
    before = [view.clone() for view in target.layers]
    buffer, host = _host(source, 3, BPC)
    layer_block = host[0, 0].numel()
    out = DeviceCopier(source, host, InlineCopyStream(), staging_bytes=staging_slots * layer_block * LAYERS)
    out.post_saves(source.plan(SLOTS, SUBS, OUT_BLOCKS, on_device=False)).wait()
    assert _trailers_untouched(buffer, 3, BPC, source)

    into = DeviceCopier(target, host, InlineCopyStream(), staging_bytes=staging_slots * layer_block)
    start, marks = into.post_loads(target.plan(SLOTS, SUBS, IN_BLOCKS, on_device=False), range(LAYERS))
    assert len(marks) == LAYERS and all(m.reached() for m in marks) and start.seconds_until(marks[-1]) >= 0
    for layer in range(LAYERS):
        for src, dst in zip(OUT_BLOCKS, IN_BLOCKS):
            assert torch.equal(target.layers[layer][:, dst], source.layers[layer][:, src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in IN_BLOCKS]
        assert torch.equal(target.layers[layer][:, untouched], before[layer][:, untouched])
    # Negative control: a block that went elsewhere differs.
    assert not torch.equal(target.layers[0][:, 6], source.layers[0][:, 5])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_and_host_paths_write_the_same_bytes(layout):
    """The device path and KVCacheView's CPU path agree: either may serve the same stored chunk."""
    source = KVCacheView(_caches(layout, 13), NUM_BLOCKS)
    by_view, by_copier = KVCacheView(_caches(layout, 14), NUM_BLOCKS), KVCacheView(_caches(layout, 14), NUM_BLOCKS)
    _, host = _host(source, 3, BPC)
    source.copy_out(host, source.plan(SLOTS, SUBS, OUT_BLOCKS))
    by_view.copy_in(host, by_view.plan(SLOTS, SUBS, IN_BLOCKS), [0, 2])
    DeviceCopier(by_copier, host, InlineCopyStream()).post_loads(by_copier.plan(SLOTS, SUBS, IN_BLOCKS, on_device=False), [0, 2])
    assert all(torch.equal(a, b) for a, b in zip(by_view.layers, by_copier.layers))
    assert not torch.equal(by_copier.layers[1], source.layers[1])  # layer 1 was not asked for


def test_an_empty_plan_queues_nothing_and_still_marks_every_layer():
    view = KVCacheView(_caches("cpu", 15), NUM_BLOCKS)
    before = [v.clone() for v in view.layers]
    _, host = _host(view, 1, BPC)
    _, marks = DeviceCopier(view, host, InlineCopyStream()).post_loads(view.plan([], [], [], on_device=False), range(LAYERS))
    assert len(marks) == LAYERS and all(torch.equal(a, b) for a, b in zip(before, view.layers))


def _layer_major_host(view: KVCacheView, slots: int) -> tuple[np.ndarray, torch.Tensor]:
    buffer = np.zeros(slots * LAYERS * view.layer_block_bytes(BPC), dtype=np.uint8)
    return buffer, view.host_blocks(buffer, slots, BPC, layer_major=True)


@pytest.mark.parametrize("layout", ["flash_attention", "LBHNC", "mla"])
def test_a_layer_major_hit_is_one_copy_per_layer_and_the_same_bytes(layout):
    """Chunks in consecutive layer-major slots: each layer is one host->device copy of chunks x Layer Block."""
    source = KVCacheView(_caches(layout, 15), NUM_BLOCKS)
    chunk_major, layer_major = KVCacheView(_caches(layout, 16), NUM_BLOCKS), KVCacheView(_caches(layout, 16), NUM_BLOCKS)
    _, by_chunk = _host(source, 6, BPC)
    _, by_layer = _layer_major_host(source, 6)
    # A four-chunk hit in slots 1..4, all blocks of each chunk, scattered over the cache.
    slots, subs = [s for s in (1, 2, 3, 4) for _ in range(BPC)], [0, 1] * 4
    blocks = [7, 2, 5, 0, 3, 1, 6, 4]
    plan = source.plan(slots, subs, [1, 4, 6, 0, 2, 3, 5, 7], on_device=False)
    for host in (by_chunk, by_layer):
        DeviceCopier(source, host, InlineCopyStream()).post_saves(plan).wait()
    layer_block = by_layer[0, 0].numel()
    loads = []
    for view, host in ((chunk_major, by_chunk), (layer_major, by_layer)):
        copier = DeviceCopier(view, host, InlineCopyStream())
        copier.post_loads(view.plan(slots, subs, blocks, on_device=False), range(LAYERS))
        loads.append(copier.last_load_copy_bytes)
    assert loads == [[layer_block] * 4, [4 * layer_block]]
    assert all(torch.equal(a, b) for a, b in zip(chunk_major.layers, layer_major.layers))
    # Negative control: the loaded blocks are the source's (the two loads could agree by both doing nothing).
    assert torch.equal(layer_major.layers[1][:, 7], source.layers[1][:, 1])
    assert not torch.equal(layer_major.layers[1][:, 7], source.layers[1][:, 4])


def test_slots_that_are_not_consecutive_are_one_copy_per_run():
    view = KVCacheView(_caches("LBHNC", 17), NUM_BLOCKS)
    _, host = _layer_major_host(view, 8)
    copier = DeviceCopier(view, host, InlineCopyStream())
    copier.post_loads(view.plan([6, 1, 2, 5], [0, 0, 0, 0], [3, 4, 5, 6], on_device=False), range(LAYERS))
    layer_block = host[0, 0].numel()
    assert copier.last_load_copy_bytes == [2 * layer_block, 2 * layer_block]  # runs 1-2 and 5-6
    # A staging area of three slots splits the run 5-6 between batches.
    small = DeviceCopier(view, host, InlineCopyStream(), staging_bytes=3 * layer_block)
    small.post_loads(view.plan([6, 1, 2, 5], [0, 0, 0, 0], [3, 4, 5, 6], on_device=False), range(LAYERS))
    assert small.last_load_copy_bytes == [2 * layer_block, layer_block, layer_block]
