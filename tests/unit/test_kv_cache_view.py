"""KVCacheView and KVRegions on CPU tensors, for every KV cache layout vLLM allocates.

Bytes must survive cache -> host buffer -> another cache unchanged, land only
in the planned blocks, and the NIXL rows must name exactly the bytes the
tensor views hold (what a peer READs is what the cache holds).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dualpath_connector.cache.kv_cache_view import KVCacheView
from dualpath_dev import kv_layouts
from dualpath_dev.kv_layouts import CacheShape
from dualpath_connector.cache.kv_regions import KVRegions, full_block_rows
from dualpath_connector.protocol import ProtocolError
from nixl_backends.layout import BlockLayout

NUM_BLOCKS, BLOCK, HEADS, DIM, LAYERS = 8, 4, 2, 8, 3


SHAPE = CacheShape(LAYERS, NUM_BLOCKS, BLOCK, HEADS, DIM)
LAYOUTS = sorted(kv_layouts.LAYOUTS)


def _caches(layout: str, seed: int) -> list[torch.Tensor]:
    return kv_layouts.make_caches(layout, SHAPE, seed)


_TRAILER_SENTINEL = 0xA5


def _host(view: KVCacheView, slots: int, bpc: int) -> tuple[np.ndarray, torch.Tensor]:
    """Slots as the pools hold them: each a stored object, the Full Block then its integrity trailer."""
    layout = BlockLayout(LAYERS, view.layer_block_bytes(bpc))
    buffer = np.zeros(slots * layout.object_bytes, dtype=np.uint8)
    buffer.reshape(slots, -1)[:, layout.full_block_bytes :] = _TRAILER_SENTINEL
    return buffer, view.host_blocks(buffer, slots, bpc)


def _trailers_untouched(buffer: np.ndarray, slots: int, bpc: int, view: KVCacheView) -> bool:
    layout = BlockLayout(LAYERS, view.layer_block_bytes(bpc))
    return bool((buffer.reshape(slots, -1)[:, layout.full_block_bytes :] == _TRAILER_SENTINEL).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_round_trip_through_a_host_buffer_into_another_cache(layout):
    source, target = KVCacheView(_caches(layout, 1), NUM_BLOCKS), KVCacheView(_caches(layout, 2), NUM_BLOCKS)
    assert source.outer == kv_layouts.LAYOUTS[layout][1](SHAPE) and source.num_layers == LAYERS
    before = [view.clone() for view in target.layers]
    bpc = 2
    buffer, host = _host(source, 2, bpc)
    # Two chunks (slots 1 and 0), blocks out of order, as vLLM hands them out.
    out_blocks, in_blocks = [5, 2, 7, 0], [1, 6, 3, 4]
    source.copy_out(host, source.plan([1, 1, 0, 0], [0, 1, 0, 1], out_blocks))
    # The copy fills the Full Blocks and leaves each slot's integrity trailer alone.
    assert _trailers_untouched(buffer, 2, bpc, source)
    target.copy_in(host, target.plan([1, 1, 0, 0], [0, 1, 0, 1], in_blocks), range(LAYERS))
    for layer in range(LAYERS):
        for src, dst in zip(out_blocks, in_blocks):
            assert torch.equal(target.layers[layer][:, dst], source.layers[layer][:, src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in in_blocks]
        assert torch.equal(target.layers[layer][:, untouched], before[layer][:, untouched])
    # Negative control: the comparison sees a block that went elsewhere.
    assert not torch.equal(target.layers[0][:, 1], source.layers[0][:, 2])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layer_subset_copies_only_those_layers(layout):
    source, target = KVCacheView(_caches(layout, 3), NUM_BLOCKS), KVCacheView(_caches(layout, 4), NUM_BLOCKS)
    before = [view.clone() for view in target.layers]
    _, host = _host(source, 1, 1)
    source.copy_out(host, source.plan([0], [0], [3]))
    target.copy_in(host, target.plan([0], [0], [3]), [1])
    assert torch.equal(target.layers[1][:, 3], source.layers[1][:, 3])
    assert torch.equal(target.layers[0], before[0]) and torch.equal(target.layers[2], before[2])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nixl_rows_name_the_bytes_the_views_hold(layout):
    view = KVCacheView(_caches(layout, 5), NUM_BLOCKS)
    regions = view.regions
    blocks = np.asarray([6, 1])
    rows = regions.rows([2, 0], blocks)
    expected = [[view.layers[layer][o, b].data_ptr(), view.block_bytes, 0]
                for layer in (2, 0) for b in blocks for o in range(view.outer)]  # fmt: skip
    assert rows.tolist() == expected
    assert regions.mem_type == "DRAM"
    assert sum(length for _, length, _, _ in regions.registration()) == sum(v.numel() for v in view.layers)
    # Every row lies inside a registered region (a peer READs only registered memory).
    spans = [(start, start + length) for start, length, _, _ in regions.registration()]
    every = regions.rows(range(LAYERS), np.arange(NUM_BLOCKS))
    assert all(any(lo <= a and a + n <= hi for lo, hi in spans) for a, n, _ in every.tolist())


def test_full_block_rows_match_the_host_buffer_layout():
    view = KVCacheView(_caches("flash_attention", 6), NUM_BLOCKS)
    bpc = 2
    buffer, host = _host(view, 3, bpc)
    layout = BlockLayout(LAYERS, view.layer_block_bytes(bpc))
    slot_addrs = [buffer.ctypes.data + s * layout.object_bytes for s in range(3)]
    # Chunk in slot 2 from sub-block 1 (its first block was a local prefix hit), then slot 0 whole.
    rows = full_block_rows([slot_addrs[2], slot_addrs[0]], [1, 0], [1, 2], [1], layout.layer_block_bytes, view.outer,
                           view.block_bytes)  # fmt: skip
    expected = [[host[s, 1, sub, o].data_ptr(), view.block_bytes, 0]
                for s, sub in ((2, 1), (0, 0), (0, 1)) for o in range(view.outer)]  # fmt: skip
    assert rows.tolist() == expected


def test_full_block_rows_step_a_layer_major_buffer_by_its_band():
    """A DE's layer-major pool: chunk j's layer l is l bands (num_slots Layer Blocks each) past its layer 0."""
    view = KVCacheView(_caches("flash_attention", 6), NUM_BLOCKS)
    bpc, slots = 2, 3
    layer_block = view.layer_block_bytes(bpc)
    buffer = np.zeros(slots * LAYERS * layer_block, dtype=np.uint8)
    host = view.host_blocks(buffer, slots, bpc, layer_major=True)
    assert host[0:3, 1].is_contiguous() and host[1, 0].data_ptr() == buffer.ctypes.data + layer_block
    layer0 = [buffer.ctypes.data + s * layer_block for s in range(slots)]
    rows = full_block_rows([layer0[2], layer0[0]], [1, 0], [1, 2], [0, 2], slots * layer_block, view.outer,
                           view.block_bytes)  # fmt: skip
    expected = [[host[s, layer, sub, o].data_ptr(), view.block_bytes, 0]
                for layer in (0, 2) for s, sub in ((2, 1), (0, 0), (0, 1)) for o in range(view.outer)]  # fmt: skip
    assert rows.tolist() == expected


def test_regions_wire_form_round_trips_and_hostile_forms_are_refused():
    regions = KVCacheView(_caches("flash_infer", 7), NUM_BLOCKS).regions
    parsed = KVRegions.from_wire(regions.to_wire(), "peer-agent")
    assert parsed.agent == "peer-agent" and parsed.rows([0], np.asarray([3])).tolist() == regions.rows([0], np.asarray([3])).tolist()
    assert parsed.same_block_geometry(regions)
    # Negative control: another block size, K/V split or layer count is another geometry.
    for other in ({"block_bytes": regions.block_bytes * 2}, {"outer": 2}, {"layer_addrs": regions.layer_addrs[:-1]}):
        assert not parsed.same_block_geometry(dataclasses.replace(regions, **other))
    wire = regions.to_wire()
    for bad in ({"layer_addrs": []}, {"layer_addrs": ["0x10"]}, {"outer": 0}, {"block_bytes": True},
                {"mem_type": "DISK"}, {"device_id": -1}):  # fmt: skip
        with pytest.raises(ProtocolError):
            KVRegions.from_wire({**wire, **bad}, "peer")
    with pytest.raises(ProtocolError):
        KVRegions.from_wire("not an object", "peer")


def test_layouts_that_are_not_a_dense_permutation_are_refused():
    with pytest.raises(ValueError, match="not a permutation"):
        # Within a block, every other element: a block is not one run of bytes.
        KVCacheView([torch.empty(2, NUM_BLOCKS, BLOCK * 2)[:, :, ::2]], NUM_BLOCKS)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheView([torch.empty(2, NUM_BLOCKS + 1, BLOCK)], NUM_BLOCKS)


def test_a_cache_on_another_device_type_is_refused():
    """The copy paths are the CPU's inline copies and CUDA's copy streams; anything else is refused by name."""
    with pytest.raises(ValueError, match="'meta' device"):
        KVCacheView([torch.empty(2, NUM_BLOCKS, BLOCK, device="meta")], NUM_BLOCKS)
