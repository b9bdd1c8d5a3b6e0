"""s3agg-gateway as a real process in front of a real SeaweedFS, read through the s3agg client backend.

Payload bytes are compared with the objects written; refused requests must
leave the client's target buffer exactly as it was (a sentinel pattern).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.request
import uuid

import boto3
import numpy as np
import pytest
from botocore.config import Config as BotoConfig
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from prometheus_client import REGISTRY

from nixl_backends.layout import BlockLayout
from nixl_backends.s3agg import GatewayRefused, parse_error, post_signed
from nixl_backends.s3agg_protocol import EXTENSION_QUERY, PROTOCOL_VERSION
from tests.s3agg_fixtures import (  # noqa: F401  (fixtures)
    CLIENT_ACCESS_KEY,
    CLIENT_SECRET_KEY,
    THETA,
    LayerBuffers,
    gateway,
    open_store,
    put_chunks,
    s3agg_bucket,
    start_gateway,
)

DELIVERIES = ("nixl", "http")


def make_agent(prefix: str, backends: list[str]):
    from nixl._api import nixl_agent, nixl_agent_config

    # No progress thread (NIXL's busy-polls a core); the client's own polling progresses UCX.
    config = nixl_agent_config(enable_prog_thread=False, backends=backends)
    return nixl_agent(f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}", config)


@pytest.fixture
def agent():
    """A client agent; the s3agg store adds the backends it needs."""
    return make_agent("s3agg-test", [])


@pytest.fixture
def ucx_agent():
    """An agent the tests drive by hand (no store): UCX, so the gateway can reach its buffers."""
    return make_agent("s3agg-raw", ["UCX"])


def read_all(store, keys, buffers: LayerBuffers):
    handed: list[int] = []
    result = store.read_layerwise(keys, buffers.addrs, handed.append)
    return result, handed


# --- payloads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("delivery", DELIVERIES)
@pytest.mark.parametrize("seed", range(4))
def test_assembled_layers_equal_the_chunks_layer_slices(seaweedfs, s3agg_bucket, gateway, agent, delivery, seed):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(1, 9))
    chunk_tokens = int(rng.choice([16, 32, 64]))
    layer_bytes = chunk_tokens * int(rng.integers(1, 97))  # odd sizes too: S = G * bytes per token
    num_chunks = int(rng.integers(1, 33))
    keys, blocks = put_chunks(seaweedfs, s3agg_bucket, rng, num_chunks, num_layers * layer_bytes)
    store = open_store(seaweedfs, s3agg_bucket, gateway.url, BlockLayout(num_layers, layer_bytes), agent,
                       delivery=delivery, chunk_tokens=chunk_tokens)
    buffers = LayerBuffers(agent, num_layers, num_chunks, layer_bytes)

    result, handed = read_all(store, keys, buffers)

    payload = num_chunks * num_layers * layer_bytes
    assert result.mode == ("layerwise" if payload >= THETA else "chunkwise")
    assert handed == list(range(num_layers))
    np.testing.assert_array_equal(buffers.array, buffers.expected(blocks, num_layers))
    assert result.summary["payload_bytes"] == payload
    if delivery == "nixl":
        # One notification per layer, in order (chunkwise: one for everything).
        assert result.notifications == ([str(l) for l in range(num_layers)] if result.mode == "layerwise" else ["all"])


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_layer_windows_larger_than_one_layer_assemble_the_same(seaweedfs, s3agg_bucket, start_gateway, agent,
                                                               delivery):
    """min_read_bytes makes each GET cover 3 of 7 layers; layers are then gathered from staging."""
    windowed = start_gateway(min_read_bytes=3 * 2048)
    keys, blocks = put_chunks(seaweedfs, s3agg_bucket, np.random.default_rng(7), 40, 7 * 2048)
    store = open_store(seaweedfs, s3agg_bucket, windowed.url, BlockLayout(7, 2048), agent, delivery=delivery)
    buffers = LayerBuffers(agent, 7, 40, 2048)
    result, handed = read_all(store, keys, buffers)
    assert result.mode == "layerwise" and handed == list(range(7))
    np.testing.assert_array_equal(buffers.array, buffers.expected(blocks, 7))


def test_mode_switches_exactly_at_theta(seaweedfs, s3agg_bucket, gateway, agent):
    num_layers, layer_bytes = 2, 8192  # L*S = 16 KiB; THETA = 64 KiB = 4 chunks
    rng = np.random.default_rng(11)
    keys, blocks = put_chunks(seaweedfs, s3agg_bucket, rng, 4, num_layers * layer_bytes)
    store = open_store(seaweedfs, s3agg_bucket, gateway.url, BlockLayout(num_layers, layer_bytes), agent)
    for count, mode in ((3, "chunkwise"), (4, "layerwise")):
        assert count * num_layers * layer_bytes == THETA - (4 - count) * num_layers * layer_bytes
        buffers = LayerBuffers(agent, num_layers, count, layer_bytes)
        result, handed = read_all(store, keys[:count], buffers)
        assert result.mode == mode
        assert handed == [0, 1]
        np.testing.assert_array_equal(buffers.array, buffers.expected(blocks[:count], num_layers))


def test_full_block_reads_through_the_gateway(seaweedfs, s3agg_bucket, gateway, agent):
    layout = BlockLayout(3, 4096)
    rng = np.random.default_rng(5)
    keys, blocks = put_chunks(seaweedfs, s3agg_bucket, rng, 9, layout.full_block_bytes)
    store = open_store(seaweedfs, s3agg_bucket, gateway.url, layout, agent)
    assert store.lookup(keys) == len(keys)
    target = np.zeros_like(blocks)
    agent.register_memory([(target.ctypes.data, target.nbytes, 0, "")], "DRAM")
    # Scattered destinations (reverse order) prove the chunk-major target addressing.
    addrs = [target.ctypes.data + (len(keys) - 1 - j) * layout.full_block_bytes for j in range(len(keys))]
    before = REGISTRY.get_sample_value("s3agg_client_fallbacks_total", {"op": "read"}) or 0.0
    assert store.read(keys, addrs) == [True] * len(keys)
    np.testing.assert_array_equal(target[::-1], blocks)
    assert (REGISTRY.get_sample_value("s3agg_client_fallbacks_total", {"op": "read"}) or 0.0) == before


# --- refusals ------------------------------------------------------------------------------------


def signed(gateway_url: str, bucket: str, body: bytes, secret: str = CLIENT_SECRET_KEY,
           access: str = CLIENT_ACCESS_KEY) -> tuple[int, str, str, dict]:
    conn, response = post_signed(gateway_url, f"/{bucket}?{EXTENSION_QUERY}", body, Credentials(access, secret),
                                 "us-east-1", uuid.uuid4().hex, 5.0, 30.0)
    try:
        text = response.read()
        code, message = parse_error(text) if response.status != 200 else ("", "")
        return response.status, code, message, dict(response.getheaders())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def stored(seaweedfs, s3agg_bucket):
    """Four chunks of L=4 layers of S=4096 bytes."""
    keys, blocks = put_chunks(seaweedfs, s3agg_bucket, np.random.default_rng(99), 4, 4 * 4096)
    return keys, blocks


def descriptor(keys, buffers: LayerBuffers, agent, **changes) -> dict:
    body = {
        "version": PROTOCOL_VERSION,
        "chunk_keys": list(keys),
        "num_layers": 4,
        "chunk_tokens": 32,
        "per_layer_chunk_bytes": 4096,
        "target": {
            "type": "nixl",
            "layout": "layer_major",
            "agent_metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
            "regions": [[a, len(keys) * 4096] for a in buffers.addrs],
        },
    }
    target_changes = changes.pop("target", {})
    body.update(changes)
    body["target"].update(target_changes)
    return body


BAD = {
    "unknown key": (lambda k, b: {"chunk_keys": k[:2] + ["kv/nope/00/" + "0" * 64] + k[3:]}, 404, "NoSuchKey",
                    "does not exist"),
    "size not L*S": (lambda k, b: {"per_layer_chunk_bytes": 4095}, 400, "InvalidObjectSize",
                     "has 16384 bytes, descriptor says L*S = 4*4095 = 16380"),
    "S zero": (lambda k, b: {"per_layer_chunk_bytes": 0}, 400, "InvalidArgument", "per_layer_chunk_bytes=0"),
    "S huge": (lambda k, b: {"per_layer_chunk_bytes": 1 << 40}, 400, "InvalidArgument", "per_layer_chunk_bytes="),
    "L zero": (lambda k, b: {"num_layers": 0}, 400, "InvalidArgument", "num_layers=0"),
    "L huge": (lambda k, b: {"num_layers": 100000}, 400, "InvalidArgument", "num_layers=100000"),
    "target too small": (lambda k, b: {"target": {"regions": [[a, 4 * 4096 - 1] for a in b.addrs]}}, 400,
                         "InvalidTarget", "has 16383 bytes, needs 16384"),
    "target overlapping": (lambda k, b: {"target": {"regions": [[b.addrs[0] + 8, 4 * 4096]] + [
        [a, 4 * 4096] for a in b.addrs[1:]]}}, 400, "InvalidTarget", "overlap"),
    "target unregistered": (lambda k, b: {"target": {"regions": [[a + (1 << 40), 4 * 4096] for a in b.addrs]}},
                            400, "InvalidTarget", "not memory registered"),
    "wrong region count": (lambda k, b: {"target": {"regions": [[b.addrs[0], 4 * 4096]]}}, 400, "InvalidTarget",
                           "needs 4 regions, got 1"),
    "not a target type": (lambda k, b: {"target": {"type": "rdma"}}, 400, "MalformedDescriptor", "target.type"),
    "other protocol version": (lambda k, b: {"version": PROTOCOL_VERSION + 1}, 400, "UnsupportedProtocolVersion",
                               f"version {PROTOCOL_VERSION + 1}; this gateway speaks s3agg protocol version "
                               f"{PROTOCOL_VERSION}"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_descriptors_are_refused_before_anything_is_written(gateway, s3agg_bucket, stored, ucx_agent, case):
    keys, _ = stored
    buffers = LayerBuffers(ucx_agent, 4, len(keys), 4096)
    change, status, code, reason = BAD[case]
    body = json.dumps(descriptor(keys, buffers, ucx_agent, **change(keys, buffers))).encode()
    got_status, got_code, message, _ = signed(gateway.url, s3agg_bucket, body)
    assert (got_status, got_code) == (status, code), message
    assert reason in message
    assert buffers.untouched()


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"version": %d, "chunk_keys": "k"}' % PROTOCOL_VERSION,
                                  b""])
def test_malformed_bodies_are_refused(gateway, s3agg_bucket, body):
    status, code, message, _ = signed(gateway.url, s3agg_bucket, body)
    assert (status, code) == (400, "MalformedDescriptor"), message


def test_unserved_bucket_is_no_such_bucket(gateway, stored, ucx_agent):
    keys, _ = stored
    buffers = LayerBuffers(ucx_agent, 4, len(keys), 4096)
    body = json.dumps(descriptor(keys, buffers, ucx_agent)).encode()
    status, code, _, _ = signed(gateway.url, "some-other-bucket", body)
    assert (status, code) == (404, "NoSuchBucket")
    assert buffers.untouched()


@pytest.mark.parametrize(("access", "secret", "code"), [
    (CLIENT_ACCESS_KEY, "wrong-secret", "SignatureDoesNotMatch"),
    ("someone-else", CLIENT_SECRET_KEY, "InvalidAccessKeyId"),
])
def test_wrong_credentials_get_403(gateway, s3agg_bucket, stored, ucx_agent, access, secret, code):
    keys, _ = stored
    buffers = LayerBuffers(ucx_agent, 4, len(keys), 4096)
    body = json.dumps(descriptor(keys, buffers, ucx_agent)).encode()
    status, got_code, _, _ = signed(gateway.url, s3agg_bucket, body, secret=secret, access=access)
    assert (status, got_code) == (403, code)
    assert buffers.untouched()


def test_unsigned_and_ordinary_s3_requests(gateway, s3agg_bucket):
    request = urllib.request.Request(f"{gateway.url}/{s3agg_bucket}?{EXTENSION_QUERY}", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 403
    assert parse_error(refused.value.read())[0] == "AccessDenied"
    # A correctly signed ordinary S3 request is told to go to the store.
    client = boto3.client("s3", endpoint_url=gateway.url, aws_access_key_id=CLIENT_ACCESS_KEY,
                          aws_secret_access_key=CLIENT_SECRET_KEY, region_name="us-east-1",
                          config=BotoConfig(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    with pytest.raises(ClientError) as not_here:
        client.get_object(Bucket=s3agg_bucket, Key="some/key")
    assert not_here.value.response["Error"]["Code"] == "NotImplemented"
    assert not_here.value.response["ResponseMetadata"]["HTTPStatusCode"] == 501


def test_client_raises_refusals_without_falling_back(seaweedfs, s3agg_bucket, gateway, stored, agent):
    keys, _ = stored
    store = open_store(seaweedfs, s3agg_bucket, gateway.url, BlockLayout(4, 4096), agent, secret_key="wrong")
    buffers = LayerBuffers(agent, 4, len(keys), 4096)
    with pytest.raises(GatewayRefused) as refused:
        store.read_layerwise(keys, buffers.addrs, lambda layer: None)
    assert (refused.value.status, refused.value.code) == (403, "SignatureDoesNotMatch")
    assert buffers.untouched()


# --- failure and fallback ------------------------------------------------------------------------


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_gateway_stopped_mid_request_falls_back_to_plain_s3(seaweedfs, s3agg_bucket, start_gateway, agent, delivery,
                                                             caplog):
    # Paced at 1 MB/s, each 128 KiB layer takes ~0.13 s: the stop lands mid-request.
    paced = start_gateway(bandwidth_cap_bytes_s=1e6, policy="equal", epoch_s=0.01)
    num_layers, layer_bytes, num_chunks = 8, 8192, 16
    keys, blocks = put_chunks(seaweedfs, s3agg_bucket, np.random.default_rng(3), num_chunks,
                              num_layers * layer_bytes)
    store = open_store(seaweedfs, s3agg_bucket, paced.url, BlockLayout(num_layers, layer_bytes), agent,
                       delivery=delivery)
    buffers = LayerBuffers(agent, num_layers, num_chunks, layer_bytes)
    handed: list[int] = []

    def on_layer(layer: int) -> None:
        if not handed:
            os.killpg(paced.proc.pid, signal.SIGKILL)
            paced.proc.wait()
        handed.append(layer)

    before = REGISTRY.get_sample_value("s3agg_client_fallbacks_total", {"op": "read_layerwise"}) or 0.0
    with caplog.at_level("WARNING", logger="nixl_backends.s3agg"):
        result = store.read_layerwise(keys, buffers.addrs, on_layer)
    assert result.mode == "fallback"
    assert result.error
    assert handed == list(range(num_layers))
    np.testing.assert_array_equal(buffers.array, buffers.expected(blocks, num_layers))
    assert REGISTRY.get_sample_value("s3agg_client_fallbacks_total", {"op": "read_layerwise"}) == before + 1
    assert any("falls back to plain S3" in r.getMessage() and result.request_id in r.getMessage()
               for r in caplog.records)


def test_unreachable_gateway_falls_back(seaweedfs, s3agg_bucket, stored, agent):
    from dualpath_dev.processes import free_port

    keys, blocks = stored
    store = open_store(seaweedfs, s3agg_bucket, f"http://127.0.0.1:{free_port()}", BlockLayout(4, 4096), agent)
    buffers = LayerBuffers(agent, 4, len(keys), 4096)
    result, handed = read_all(store, keys, buffers)
    # Refused, or reset when something else grabbed the free port meanwhile: either way a fallback.
    assert result.mode == "fallback" and result.error.startswith(f"gateway {store.config.gateway}")
    assert handed == [0, 1, 2, 3]
    np.testing.assert_array_equal(buffers.array, buffers.expected(blocks, 4))


# --- tracing -------------------------------------------------------------------------------------


def test_request_id_metrics_and_no_secrets_in_logs(seaweedfs, s3agg_bucket, gateway, stored, agent):
    keys, _ = stored
    store = open_store(seaweedfs, s3agg_bucket, gateway.url, BlockLayout(4, 4096), agent)
    buffers = LayerBuffers(agent, 4, len(keys), 4096)
    request_id = f"trace-{uuid.uuid4().hex}"
    result = store.read_layerwise(keys, buffers.addrs, lambda layer: None, request_id=request_id)
    assert result.request_id == request_id == result.summary["request_id"]
    assert set(result.summary["timings_s"]) >= {"control_s", "storage_read_s", "delivery_s"}
    with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 's3agg_requests_total{mode="layerwise",outcome="ok",target="nixl"}' in metrics
    assert 's3agg_request_phase_seconds_count{phase="storage_read"}' in metrics
    log = gateway.log_text()
    line = next(line for line in log.splitlines() if request_id in line)
    assert "control=" in line and "storage_read=" in line and "delivery=" in line
    assert CLIENT_SECRET_KEY not in log and seaweedfs.secret_key not in log
