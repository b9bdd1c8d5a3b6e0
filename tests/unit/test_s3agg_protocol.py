"""The s3agg wire protocol: what the client writes, the gateway reads, version checks included."""

from __future__ import annotations

import json

import pytest

from nixl_backends.s3agg_protocol import (
    ALL_LAYERS,
    LAYOUT_CHUNK_MAJOR,
    LAYOUT_LAYER_MAJOR,
    PROTOCOL_VERSION,
    VERSION,
    descriptor_body,
    encode_notification,
    http_target,
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
    regions = [[4096 * (1 + layer), len(KEYS) * 256] for layer in range(4)]
    body = descriptor_body(KEYS, 4, 16, 256, nixl_target(b"metadata", LAYOUT_LAYER_MAJOR, regions), 0.01)
    desc = parse_descriptor("kv-bucket", body, CONFIG)
    assert (desc.chunk_keys, desc.num_layers, desc.chunk_tokens, desc.layer_bytes) == (tuple(KEYS), 4, 16, 256)
    assert desc.compute_window_s == 0.01
    assert isinstance(desc.target, NixlTarget)
    assert desc.target.agent_metadata == b"metadata" and desc.target.layout == LAYOUT_LAYER_MAJOR
    assert desc.target.addrs.tolist() == [r[0] for r in regions]


def test_the_gateway_parses_what_the_client_writes_chunk_major_and_http():
    regions = [[8192 * (1 + j), 4 * 256] for j in range(len(KEYS))]
    body = descriptor_body(KEYS, 4, 16, 256, nixl_target(b"m", LAYOUT_CHUNK_MAJOR, regions))
    assert parse_descriptor("kv-bucket", body, CONFIG).target.layout == LAYOUT_CHUNK_MAJOR
    http = parse_descriptor("kv-bucket", descriptor_body(KEYS, 4, 16, 256, http_target()), CONFIG)
    assert isinstance(http.target, HttpTarget) and http.compute_window_s is None


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
