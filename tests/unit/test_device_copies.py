"""DeviceCopier's copy plans on CPU tensors, every layout, with InlineCopyStream standing in for a CUDA stream.

Without a GPU the stream/event ordering cannot run here (``scripts/gpu_connector_check.py``
checks it on one); what runs is everything else: batching over staging, the per-slot
copies and the device-side scatter and gather, checked byte for byte against the blocks.
"""

from __future__ import annotations

import pytest
import torch

from dualpath_connector.copy_stream import InlineCopyStream
from dualpath_connector.device_copies import DeviceCopier
from dualpath_connector.kv_cache_view import KVCacheView
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
