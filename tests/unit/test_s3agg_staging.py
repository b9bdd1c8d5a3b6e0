"""The gateway's staging bounds: a request's plan fits its limit or is refused; the budget caps all requests
together. Abandoned staging, freed once every NIXL transfer that may touch it ended, is in ``test_abandoned.py``."""

from __future__ import annotations

import threading

import pytest

from s3agg_gateway_ext.descriptor import Descriptor, DescriptorError, HttpTarget
from s3agg_gateway_ext.staging import StagingBudget, StagingBusy, staging_plan

MIB = 1 << 20
D = 16


def descriptor(num_chunks: int, num_layers: int, layer_bytes: int) -> Descriptor:
    return Descriptor("bucket", tuple(f"k{i}" for i in range(num_chunks)), num_layers, 16, layer_bytes, D, None,
                      HttpTarget())


def test_chunkwise_stages_whole_objects_and_is_refused_above_the_request_limit():
    desc = descriptor(8, 4, 1024)
    plan = staging_plan(desc, layerwise=False, min_read_bytes=4 * MIB, max_request_bytes=desc.payload_bytes)
    assert (plan.whole_objects, plan.nbytes) == (True, desc.payload_bytes)
    with pytest.raises(DescriptorError) as refused:
        staging_plan(desc, layerwise=False, min_read_bytes=4 * MIB, max_request_bytes=desc.payload_bytes - 1)
    assert (refused.value.status, refused.value.code) == (400, "InvalidArgument")
    assert "max_request_staging_bytes" in refused.value.message


def test_layerwise_windows_are_the_fewest_layers_of_min_read_bytes():
    desc = descriptor(4, 32, MIB)
    plan = staging_plan(desc, layerwise=True, min_read_bytes=4 * MIB, max_request_bytes=1 << 40)
    trailers = 4 * 32 * D
    assert (plan.window_layers, plan.whole_objects) == (4, False)
    assert plan.nbytes == trailers + 2 * 4 * 4 * (MIB + D)  # two windows of 4 layers of every chunk


def test_one_window_of_every_layer_is_the_whole_object_while_it_fits():
    desc = descriptor(4, 8, 64 * 1024)  # 512 KiB per object: under min_read_bytes
    plan = staging_plan(desc, layerwise=True, min_read_bytes=4 * MIB, max_request_bytes=desc.payload_bytes)
    assert (plan.window_layers, plan.whole_objects, plan.nbytes) == (8, True, desc.payload_bytes)


def test_windows_shrink_until_the_staging_fits_and_never_exceed_the_limit():
    desc = descriptor(4, 32, MIB)
    trailers = 4 * 32 * D
    for limit in (desc.payload_bytes - 1, trailers + 2 * 4 * 3 * (MIB + D), trailers + 2 * 4 * (MIB + D)):
        plan = staging_plan(desc, layerwise=True, min_read_bytes=64 * MIB, max_request_bytes=limit)
        assert not plan.whole_objects and 1 <= plan.window_layers < 32
        assert plan.nbytes == trailers + 2 * 4 * plan.window_layers * (MIB + D) <= limit
        # The largest window that fits: one more layer would not.
        assert trailers + 2 * 4 * (plan.window_layers + 1) * (MIB + D) > limit or plan.window_layers == 31
    assert staging_plan(desc, True, 64 * MIB, trailers + 2 * 4 * 3 * (MIB + D)).window_layers == 3


def test_a_request_that_does_not_fit_with_one_layer_per_window_is_refused():
    desc = descriptor(4, 32, MIB)
    with pytest.raises(DescriptorError) as refused:
        staging_plan(desc, layerwise=True, min_read_bytes=0, max_request_bytes=4 * 32 * D + 2 * 4 * (MIB + D) - 1)
    assert (refused.value.status, refused.value.code) == (400, "InvalidArgument")


def test_the_budget_refuses_what_does_not_fit_and_a_waiter_gets_bytes_given_back():
    budget = StagingBudget(100)
    budget.take(60, timeout_s=0.0)
    with pytest.raises(StagingBusy, match="max_staging_bytes=100"):
        budget.take(50, timeout_s=0.0)
    assert budget.in_use == 60
    taken = threading.Event()
    waiter = threading.Thread(target=lambda: (budget.take(50, timeout_s=60.0), taken.set()))
    waiter.start()
    assert not taken.is_set()
    budget.give_back(60)
    waiter.join(60.0)
    assert taken.is_set() and budget.in_use == 50
