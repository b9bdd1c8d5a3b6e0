"""s3agg-gateway on the second S3 server, over TLS: the gateway's backing store and the client's lookups reach
versitygw through the CA in ``ca_bundle``; objects come back byte-equal in both delivery shapes, a truncated
object fails at the reader, and a missing one is a miss. Same helpers as ``test_s3agg_gateway.py`` (SeaweedFS)."""

from __future__ import annotations

import numpy as np
import pytest

from nixl_backends.integrity import ChunkIntegrity, chunk_hash_of
from nixl_backends.layout import BlockLayout
from tests.integration.test_s3agg_gateway import (  # noqa: F401  (fixtures)
    agent,
    assert_delivered,
    layer_buffers,
    put_objects,
    read_all,
)
from tests.s3agg_fixtures import THETA, gateway, open_store, s3agg_bucket, start_gateway  # noqa: F401


@pytest.fixture(scope="module")
def s3agg_server(versitygw):
    return versitygw


@pytest.mark.parametrize("delivery", ["nixl", "http"])
def test_layers_through_a_gateway_on_a_tls_store_equal_the_stored_objects(versitygw, s3agg_bucket, gateway, agent,
                                                                         delivery):
    layout = BlockLayout(4, 4096)
    keys, objects = put_objects(versitygw, s3agg_bucket, np.random.default_rng(7), 6, layout)
    assert 6 * layout.object_bytes >= THETA  # layer by layer
    store = open_store(versitygw, s3agg_bucket, gateway.url, layout, agent, delivery=delivery)
    assert store.lookup(keys) == len(keys)
    buffers = layer_buffers(agent, layout, len(keys))
    result, handed = read_all(store, keys, buffers)
    assert result.mode == "layerwise" and handed == list(range(layout.num_layers))
    assert_delivered(layout, keys, objects, buffers)


def test_whole_objects_short_and_missing_ones_on_a_tls_store(versitygw, s3agg_bucket, gateway, agent):
    """Chunkwise reads of objects; one cut short behind the store's back fails alone, a missing key ends the
    lookup's run (the reader never sees it)."""
    layout = BlockLayout(3, 4096)
    keys, objects = put_objects(versitygw, s3agg_bucket, np.random.default_rng(8), 3, layout)
    versitygw.client().put_object(Bucket=s3agg_bucket, Key=keys[1], Body=objects[1, :-100].tobytes())
    store = open_store(versitygw, s3agg_bucket, gateway.url, layout, agent)
    assert store.lookup([keys[0], keys[2], keys[0] + "-missing"]) == 2
    target = np.zeros_like(objects)
    agent.register_memory([(target.ctypes.data, target.nbytes, 0, "")], "DRAM")
    addrs = [target.ctypes.data + j * layout.object_bytes for j in range(len(keys))]
    ok = store.read(keys, addrs)
    assert ok[0] and ok[2]
    integrity = ChunkIntegrity(layout)
    np.testing.assert_array_equal(target[[0, 2]], objects[[0, 2]])
    # The short object either failed its read or arrived short: its trailer cannot verify.
    assert not ok[1] or not integrity.verify(chunk_hash_of(keys[1]), target[1])
