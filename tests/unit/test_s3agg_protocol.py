"""The s3agg wire protocol: what the client writes, the gateway reads, version and trailer checks included."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nixl_backends.integrity import ChunkIntegrity
from nixl_backends.layout import DIGEST_BYTES, BlockLayout
from nixl_backends.s3agg_protocol import (
    ALL_LAYERS,
    DIGEST_BYTES_KEY,
    LAYOUT_CHUNK_MAJOR,
    LAYOUT_LAYER_MAJOR,
    LAYOUT_STRIDED,
    PROTOCOL_VERSION,
    VERSION,
    descriptor_body,
    encode_notification,
    http_target,
    layer_region_bytes,
    nixl_target,
    parse_notification,
)
from s3agg_gateway_ext.descriptor import DescriptorError, HttpTarget, NixlTarget, parse_descriptor
from s3agg_gateway_ext.config import parse_config

CONFIG = parse_config({
    "store": {"backend": "s3", "endpoint": "http://127.0.0.1:8333", "bucket": "kv-bucket"},
    "client_access_key": "client",
    "client_secret_key": "client-secret-value",
})
KEYS = ["kv/a", "kv/b", "kv/c"]


@pytest.mark.parametrize(("layer", "token"), [(0, "0"), (17, "17"), (None, ALL_LAYERS)])
def test_notifications_round_trip(layer, token):
    # Request ids may contain colons; the token is what follows the last one.
    assert parse_notification(encode_notification("req:42", layer)) == ("req:42", token)


def test_other_notifications_are_not_the_gateways():
    assert parse_notification(b"peer-done:abc") is None


def test_the_gateway_parses_what_the_client_writes_nixl_target():
    regions = [[4096 * (1 + layer), layer_region_bytes(len(KEYS), 256)] for layer in range(4)]
    body = descriptor_body(KEYS, 4, 16, 256, nixl_target(b"metadata", LAYOUT_LAYER_MAJOR, regions), 0.01)
    desc = parse_descriptor("kv-bucket", body, CONFIG)
    assert (desc.chunk_keys, desc.num_layers, desc.chunk_tokens, desc.layer_bytes, desc.digest_bytes) == (
        tuple(KEYS), 4, 16, 256, DIGEST_BYTES)
    assert desc.object_bytes == BlockLayout(4, 256).object_bytes
    assert desc.payload_bytes == len(KEYS) * desc.object_bytes
    assert desc.compute_window_s == 0.01
    assert isinstance(desc.target, NixlTarget)
    assert desc.target.agent_metadata == b"metadata" and desc.target.layout == LAYOUT_LAYER_MAJOR
    assert desc.target.addrs.tolist() == [r[0] for r in regions]


def test_the_gateway_parses_what_the_client_writes_chunk_major_and_http():
    regions = [[8192 * (1 + j), BlockLayout(4, 256).object_bytes] for j in range(len(KEYS))]
    body = descriptor_body(KEYS, 4, 16, 256, nixl_target(b"m", LAYOUT_CHUNK_MAJOR, regions))
    assert parse_descriptor("kv-bucket", body, CONFIG).target.layout == LAYOUT_CHUNK_MAJOR
    http = parse_descriptor("kv-bucket", descriptor_body(KEYS, 4, 16, 256, http_target()), CONFIG)
    assert isinstance(http.target, HttpTarget) and http.compute_window_s is None


# Non-finite windows (NaN, Infinity, 1e999 parses as inf) stopped the bandwidth scheduler's thread.
@pytest.mark.parametrize("window", ["NaN", "Infinity", "-Infinity", "1e999", "-1", "0", "61", '"0.1"', "true"])
def test_a_compute_window_not_a_number_of_seconds_is_refused(window):
    body = descriptor_body(KEYS, 4, 16, 256, http_target(), 0.01).decode()
    assert body.count("0.01") == 1
    with pytest.raises(DescriptorError) as refused:
        parse_descriptor("kv-bucket", body.replace("0.01", window).encode(), CONFIG)
    assert refused.value.status == 400
    message = refused.value.message  # names the field, or the token JSON does not have
    assert "compute_window_s must be a number of seconds" in message or f"{window} is not a JSON number" in message


def _with_version(version) -> bytes:
    body = json.loads(descriptor_body(KEYS, 4, 16, 256, http_target()))
    if version is None:
        del body[VERSION]
    else:
        body[VERSION] = version
    return json.dumps(body).encode()


def test_the_client_sends_the_protocol_version():
    assert json.loads(descriptor_body(KEYS, 4, 16, 256, http_target()))[VERSION] == PROTOCOL_VERSION


@pytest.mark.parametrize(("version", "named"), [
    (PROTOCOL_VERSION + 1, f"version {PROTOCOL_VERSION + 1}"),
    ("1", "version '1'"),
    (True, "version True"),
    (None, "no version"),
])
def test_another_or_no_version_is_refused_naming_both(version, named):
    with pytest.raises(DescriptorError) as refused:
        parse_descriptor("kv-bucket", _with_version(version), CONFIG)
    assert (refused.value.status, refused.value.code) == (400, "UnsupportedProtocolVersion")
    assert named in refused.value.message
    assert f"protocol version {PROTOCOL_VERSION}" in refused.value.message


def test_the_version_is_checked_before_the_keys_it_may_change():
    body = json.loads(_with_version(PROTOCOL_VERSION + 1))
    body["a_key_of_the_next_version"] = 1
    with pytest.raises(DescriptorError, match="protocol version"):
        parse_descriptor("kv-bucket", json.dumps(body).encode(), CONFIG)


def test_an_old_client_without_trailers_is_refused():
    """Protocol 1 clients expect L*S objects and no digests: the version alone refuses them."""
    body = json.loads(descriptor_body(KEYS, 4, 16, 256, http_target()))
    body[VERSION] = 1
    del body[DIGEST_BYTES_KEY]
    with pytest.raises(DescriptorError) as refused:
        parse_descriptor("kv-bucket", json.dumps(body).encode(), CONFIG)
    assert refused.value.code == "UnsupportedProtocolVersion"
    assert f"descriptor has version 1; this gateway speaks s3agg protocol version {PROTOCOL_VERSION}" in \
        refused.value.message


def test_the_client_declares_the_stored_digest_size():
    assert json.loads(descriptor_body(KEYS, 4, 16, 256, http_target()))[DIGEST_BYTES_KEY] == DIGEST_BYTES


@pytest.mark.parametrize("digest_bytes", [DIGEST_BYTES // 2, DIGEST_BYTES * 2, 0, str(DIGEST_BYTES), True, None])
def test_another_digest_size_is_refused_naming_the_field(digest_bytes):
    body = json.loads(descriptor_body(KEYS, 4, 16, 256, http_target()))
    if digest_bytes is None:
        del body[DIGEST_BYTES_KEY]
    else:
        body[DIGEST_BYTES_KEY] = digest_bytes
    with pytest.raises(DescriptorError) as refused:
        parse_descriptor("kv-bucket", json.dumps(body).encode(), CONFIG)
    assert (refused.value.status, refused.value.code) == (400, "InvalidArgument")
    assert f"{DIGEST_BYTES_KEY}={digest_bytes!r}" in refused.value.message
    assert f"{DIGEST_BYTES}-byte" in refused.value.message


LAYER_REGION, OBJECT = layer_region_bytes(len(KEYS), 256), BlockLayout(4, 256).object_bytes


@pytest.mark.parametrize(("layout", "count", "length", "needed"), [
    (LAYOUT_LAYER_MAJOR, 4, len(KEYS) * 256, LAYER_REGION),  # protocol 1's size: no room for the digests
    (LAYOUT_LAYER_MAJOR, 4, LAYER_REGION - 1, LAYER_REGION),
    (LAYOUT_CHUNK_MAJOR, len(KEYS), 4 * 256, OBJECT),
    (LAYOUT_CHUNK_MAJOR, len(KEYS), OBJECT - 1, OBJECT),
])
def test_target_regions_must_hold_the_digests(layout, count, length, needed):
    regions = [[(1 + i) << 20, length] for i in range(count)]
    body = descriptor_body(KEYS, 4, 16, 256, nixl_target(b"m", layout, regions))
    with pytest.raises(DescriptorError) as refused:
        parse_descriptor("kv-bucket", body, CONFIG)
    assert (refused.value.code, refused.value.message) == (
        "InvalidTarget", f"target region 0 has {length} bytes, needs {needed}")


@pytest.mark.parametrize("layout", [LAYOUT_LAYER_MAJOR, LAYOUT_CHUNK_MAJOR])
def test_target_addresses_put_each_digest_where_the_protocol_says(layout):
    n, num_layers, s, d = len(KEYS), 4, 256, DIGEST_BYTES
    count, length = (num_layers, LAYER_REGION) if layout == LAYOUT_LAYER_MAJOR else (n, OBJECT)
    regions = [[(1 + i) << 20, length] for i in range(count)]
    desc = parse_descriptor("kv-bucket", descriptor_body(KEYS, num_layers, 16, s, nixl_target(b"m", layout, regions)),
                            CONFIG)
    chunks, layers = np.arange(n)[:, None], np.arange(num_layers)[None, :]
    blocks, digests = desc.target_addrs(chunks, layers)
    for j in range(n):
        for layer in range(num_layers):
            if layout == LAYOUT_LAYER_MAJOR:
                region, block, digest = regions[layer][0], j * s, n * s + j * d
            else:
                region, block, digest = regions[j][0], layer * s, num_layers * s + layer * d
            assert (blocks[j, layer], digests[j, layer]) == (region + block, region + digest)


def test_a_strided_target_puts_layer_l_a_stride_further_and_digests_in_the_trailer():
    """A layer-major pool's slots: chunk j's layer l at first_j + l*stride, its digest at trailer_j + l*D."""
    n, num_layers, s, d, stride = len(KEYS), 4, 256, DIGEST_BYTES, 8 * 256
    firsts = [(1 << 20) + j * s for j in (0, 1, 5)]  # slots 0, 1 and 5 of an 8-slot band
    trailers = [(2 << 20) + j * num_layers * d for j in (0, 1, 5)]
    target = nixl_target(b"m", LAYOUT_STRIDED, list(zip(firsts, trailers)), stride)
    desc = parse_descriptor("kv-bucket", descriptor_body(KEYS, num_layers, 16, s, target), CONFIG)
    blocks, digests = desc.target_addrs(np.arange(n)[:, None], np.arange(num_layers)[None, :])
    for j in range(n):
        for layer in range(num_layers):
            assert (blocks[j, layer], digests[j, layer]) == (firsts[j] + layer * stride, trailers[j] + layer * d)
    assert len(desc.target.spans()[0]) == n * num_layers + n  # every Layer Block and trailer is checked registered


@pytest.mark.parametrize(("change", "message"), [
    ({"firsts": [1 << 20, (1 << 20) + 8, 3 << 20]}, "overlap"),  # chunk 1's layers inside chunk 0's
    ({"stride": 2 * 256}, "overlap"),  # a band narrower than the hit: chunk 0's layer 1 is chunk 2's layer 0
    ({"trailers": [(2 << 20), (2 << 20) + 8, 3 << 20]}, "overlap"),
    ({"stride": 100}, "layer_stride"),
    ({"stride": None}, "layer_stride"),
    ({"firsts": [1 << 20, 2 << 20]}, "needs 3 regions"),
    ({"firsts": [(1 << 64) - 512, 1 << 20, 2 << 20]}, "64-bit"),
])
def test_bad_strided_targets_are_refused(change, message):
    firsts = change.get("firsts", [(1 << 20) + j * 256 for j in range(3)])
    trailers = change.get("trailers", [(4 << 20) + j * 64 for j in range(len(firsts))])
    target = nixl_target(b"m", LAYOUT_STRIDED, list(zip(firsts, trailers)), change.get("stride", 3 * 256))
    if "stride" in change and change["stride"] is None:
        del target["layer_stride"]
    with pytest.raises(DescriptorError, match=message):
        parse_descriptor("kv-bucket", descriptor_body(KEYS, 4, 16, 256, target), CONFIG)


def test_a_layer_stride_is_refused_with_another_layout():
    target = nixl_target(b"m", LAYOUT_CHUNK_MAJOR, [[(1 + j) << 20, OBJECT] for j in range(3)])
    target["layer_stride"] = 4096
    with pytest.raises(DescriptorError, match="layer_stride"):
        parse_descriptor("kv-bucket", descriptor_body(KEYS, 4, 16, 256, target), CONFIG)


def _layer_major(objects: np.ndarray, layout: BlockLayout, layer: int) -> np.ndarray:
    start, end = layout.layer_range(layer)
    d_start, d_end = layout.digest_range(layer)
    return np.concatenate([objects[:, start:end].ravel(), objects[:, d_start:d_end].ravel()])


def test_verify_layer_major_counts_the_leading_intact_chunks():
    layout = BlockLayout(3, 64)
    integrity = ChunkIntegrity(layout)
    rng = np.random.default_rng(1)
    hashes = [rng.bytes(32).hex() for _ in range(5)]
    objects = rng.integers(0, 256, size=(5, layout.object_bytes), dtype=np.uint8)
    for chunk_hash, obj in zip(hashes, objects):
        integrity.seal(chunk_hash, obj)
    for layer in range(3):
        assert integrity.verify_layer_major(hashes, layer, _layer_major(objects, layout, layer)) == 5
    # Negative controls: a flipped byte of chunk 2's layer, a flipped digest of chunk 3, the wrong layer.
    region = _layer_major(objects, layout, 1)
    region[2 * 64 + 7] ^= 1
    assert integrity.verify_layer_major(hashes, 1, region) == 2
    region = _layer_major(objects, layout, 1)
    region[5 * 64 + 3 * DIGEST_BYTES] ^= 1
    assert integrity.verify_layer_major(hashes, 1, region) == 3
    assert integrity.verify_layer_major(hashes, 0, _layer_major(objects, layout, 1)) == 0
    with pytest.raises(ValueError, match="layer-major region of 5 chunks"):
        integrity.verify_layer_major(hashes, 1, region[:-1])
