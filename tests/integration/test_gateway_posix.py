"""s3agg-gateway with a POSIX backing: a store root served as an S3 bucket and aggregated by NIXL POSIX reads.

A real gateway process over a temporary root, serving TLS with a CA made for the
run (clients trust only that file). boto3 and NIXL's OBJ plugin (the connector's
``s3`` store) use it as their S3 endpoint; chunk objects a ``PosixStore`` wrote are
delivered by the aggregated read byte for byte, with digests that verify; a
corrupted file is delivered as stored and fails verification at the reader.
NIXL OBJ's PUTs, whose bodies the signature does not cover, are accepted only by
a gateway that allows unsigned payloads, which needs TLS.
"""

from __future__ import annotations

import http.client
import os
import uuid

import boto3
import numpy as np
import pytest
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from dualpath_dev.gateway import GatewayProcess
from nixl_backends.buffers import HostBufferPool
from nixl_backends.integrity import ChunkIntegrity, chunk_hash_of
from nixl_backends.layout import DIGEST_BYTES, BlockLayout
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.s3agg import GatewayRefused, _Target
from nixl_backends.s3agg_protocol import LAYOUT_CHUNK_MAJOR, LAYOUT_STRIDED
from s3agg_gateway_ext.sigv4 import STREAMING_UNSIGNED_TRAILER, sign
from tests.s3agg_fixtures import CLIENT_ACCESS_KEY, CLIENT_SECRET_KEY, LayerBuffers

BUCKET = "kv-root"
LAYOUT = BlockLayout(4, 4096)


def nixl_agent_for(prefix: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                      nixl_agent_config(enable_prog_thread=False, backends=[]))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("posix-root")


def posix_gateway_config(root, **settings) -> dict:
    return {"store": {"backend": "posix", "root": str(root)}, "buckets": [BUCKET],
            "client_access_key": CLIENT_ACCESS_KEY, "client_secret_key": CLIENT_SECRET_KEY,
            "theta_bytes": 1, "io_threads": 4, "io_timeout_s": 20.0, **settings}


@pytest.fixture(scope="module")
def gateway(root, tmp_path_factory):
    """Over TLS, accepting NIXL OBJ's unsigned PUT bodies (as a deployment whose engines write through it must)."""
    config = posix_gateway_config(root, allow_unsigned_payload=True)
    process = GatewayProcess(config, tmp_path_factory.mktemp("posix-gateway"), tls=True).start()
    yield process
    process.stop()


def boto(gateway, secret: str = CLIENT_SECRET_KEY):
    return boto3.client("s3", endpoint_url=gateway.url, aws_access_key_id=CLIENT_ACCESS_KEY,
                        aws_secret_access_key=secret, region_name="us-east-1", verify=gateway.ca_bundle,
                        config=BotoConfig(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def s3_section(gateway) -> dict:
    section = {"backend": "s3", "endpoint": gateway.url, "bucket": BUCKET, "addressing_style": "path",
               "access_key": CLIENT_ACCESS_KEY, "secret_key": CLIENT_SECRET_KEY, "create_bucket": False}
    return {**section, "ca_bundle": gateway.ca_bundle} if gateway.ca_bundle else section


def sealed_objects(count: int, seed: int) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(seed)
    prefix = uuid.uuid4().hex
    keys = [f"dualpath/{prefix}/{j:02x}/{rng.bytes(32).hex()}" for j in range(count)]
    objects = rng.integers(0, 256, size=(count, LAYOUT.object_bytes), dtype=np.uint8)
    integrity = ChunkIntegrity(LAYOUT)
    for key, obj in zip(keys, objects):
        integrity.seal(chunk_hash_of(key), obj)
    return keys, objects


def write_with_posix_store(root, keys: list[str], objects: np.ndarray) -> None:
    """As an engine with a posix store would: through NIXL POSIX, temp file and rename."""
    agent = nixl_agent_for("posix-writer")
    store = make_store(parse_store_config({"backend": "posix", "root": str(root)}), LAYOUT, agent)
    pool = HostBufferPool(agent, LAYOUT.object_bytes, len(keys))
    try:
        slots = pool.acquire(len(keys))
        for slot, obj in zip(slots, objects):
            pool.slot_view(slot)[:] = obj
        assert store.write(keys, [pool.slot_addr(s) for s in slots]) == [True] * len(keys)
    finally:
        pool.close()
        store.close()


# --- boto3 --------------------------------------------------------------------------------------


def test_boto3_put_get_range_head_list_delete(gateway):
    s3 = boto(gateway)
    prefix = f"t/{uuid.uuid4().hex}"
    bodies = {f"{prefix}/{name}": os.urandom(1000 + i) for i, name in enumerate(["a", "b", "c/d", "c/e", "f"])}
    for key, body in bodies.items():
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)
    key = f"{prefix}/c/d"
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == bodies[key]
    assert s3.get_object(Bucket=BUCKET, Key=key, Range="bytes=10-99")["Body"].read() == bodies[key][10:100]
    assert s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == len(bodies[key])
    # Pagination: two keys per page, every key once, in order.
    listed = [obj["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"{prefix}/", PaginationConfig={"PageSize": 2}) for obj in page.get("Contents", [])]
    assert listed == sorted(bodies)
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/c/")["Contents"]] == [
        f"{prefix}/c/d", f"{prefix}/c/e"]
    s3.delete_object(Bucket=BUCKET, Key=key)
    with pytest.raises(ClientError) as missing:
        s3.get_object(Bucket=BUCKET, Key=key)
    assert missing.value.response["Error"]["Code"] == "NoSuchKey"


def test_boto3_refusals(gateway, root):
    with pytest.raises(ClientError) as denied:
        boto(gateway, secret="not-the-secret").get_object(Bucket=BUCKET, Key="t/x")
    assert denied.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    s3 = boto(gateway)
    for key in ("t/../../escape", "t//double", "t/./dot"):
        with pytest.raises(ClientError) as hostile:
            s3.put_object(Bucket=BUCKET, Key=key, Body=b"x")
        assert hostile.value.response["Error"]["Code"] == "InvalidObjectName", key
    assert not (root.parent / "escape").exists()
    with pytest.raises(ClientError) as other:
        s3.get_object(Bucket="another-bucket", Key="t/x")
    assert other.value.response["Error"]["Code"] == "NoSuchBucket"


def test_listing_stays_in_the_bucket(gateway, root):
    """A prefix cannot walk the listing out of the root: from "/" it would walk the whole file system, and a
    symlinked directory would list (and stat) what it points at."""
    outside = root.parent / f"outside-{uuid.uuid4().hex[:6]}"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x" * 123)
    (root / "t").mkdir(exist_ok=True)
    (root / "t" / "link").symlink_to(outside, target_is_directory=True)
    s3 = boto(gateway)
    for prefix in ("/", "/etc/", str(outside) + "/", "t/link/", "t/../"):
        assert s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount") == 0, prefix
    # Control: an object in the bucket is listed under its own prefix.
    s3.put_object(Bucket=BUCKET, Key="t/listed", Body=b"y")
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="t/l")["Contents"]] == ["t/listed"]


# --- NIXL OBJ (the connector's s3 store) ------------------------------------------------------------


def test_nixl_obj_store_writes_and_reads_through_the_gateway(gateway, root):
    keys, objects = sealed_objects(6, seed=1)
    agent = nixl_agent_for("obj-client")
    store = make_store(parse_store_config(s3_section(gateway)), LAYOUT, agent)
    pool = HostBufferPool(agent, LAYOUT.object_bytes, 2 * len(keys))
    try:
        slots = pool.acquire(2 * len(keys))
        src, dst = slots[: len(keys)], slots[len(keys):]
        for slot, obj in zip(src, objects):
            pool.slot_view(slot)[:] = obj
        assert store.write(keys, [pool.slot_addr(s) for s in src]) == [True] * len(keys)
        # On disk exactly where a PosixStore would put them.
        for key, obj in zip(keys, objects):
            assert (root / key).read_bytes() == obj.tobytes()
        assert store.lookup(keys) == len(keys)
        assert store.read(keys, [pool.slot_addr(s) for s in dst]) == [True] * len(keys)
        for slot, obj in zip(dst, objects):
            np.testing.assert_array_equal(pool.slot_view(slot), obj)
        # Written by a PosixStore, read through the gateway by NIXL OBJ.
        more_keys, more = sealed_objects(3, seed=2)
        write_with_posix_store(root, more_keys, more)
        assert store.read(more_keys, [pool.slot_addr(s) for s in dst[:3]]) == [True] * 3
        for slot, obj in zip(dst, more):
            np.testing.assert_array_equal(pool.slot_view(slot), obj)
    finally:
        pool.close()
        store.close()


def nixl_obj_writes(gateway, seed: int, **section) -> tuple[list[bool], list[str], np.ndarray]:
    """Two sealed chunk objects written through ``gateway`` by NIXL OBJ (the connector's ``s3`` store)."""
    agent = nixl_agent_for("obj-writer")
    store = make_store(parse_store_config({**s3_section(gateway), **section}), LAYOUT, agent)
    pool = HostBufferPool(agent, LAYOUT.object_bytes, 2)
    try:
        keys, objects = sealed_objects(2, seed=seed)
        slots = pool.acquire(2)
        for slot, obj in zip(slots, objects):
            pool.slot_view(slot)[:] = obj
        return store.write(keys, [pool.slot_addr(s) for s in slots]), keys, objects
    finally:
        pool.close()
        store.close()


# The AWS C++ SDK's default: a CRC64 trailer on every PUT, sent as an aws-chunked body the signature does not
# cover (STREAMING-UNSIGNED-PAYLOAD-TRAILER), the s3 store's default over https; "when_required" signs the body.
UNSIGNED_BODY = {"request_checksum_calculation": "when_supported"}
SIGNED_BODY = {"request_checksum_calculation": "when_required"}


def test_a_put_the_signature_does_not_cover_is_refused_unless_allowed_over_tls(gateway, root, tmp_path):
    """A gateway that does not allow unsigned payloads refuses NIXL OBJ's unsigned-body PUTs, and nothing lands;
    signed ones are accepted. The module's gateway (TLS, allow_unsigned_payload) is the control: they land."""
    process = GatewayProcess(posix_gateway_config(root), tmp_path, tls=True).start()
    try:
        written, keys, _ = nixl_obj_writes(process, 11, **UNSIGNED_BODY)
        assert written == [False, False] and not any((root / key).exists() for key in keys)
        assert "PUT here needs x-amz-content-sha256: the body's SHA-256" in process.log_text()
        written, keys, objects = nixl_obj_writes(process, 12, **SIGNED_BODY)
        assert written == [True, True] and (root / keys[0]).read_bytes() == objects[0].tobytes()
    finally:
        process.stop()
    written, keys, objects = nixl_obj_writes(gateway, 13, **UNSIGNED_BODY)
    assert written == [True, True] and (root / keys[1]).read_bytes() == objects[1].tobytes()


def test_over_plain_http_an_unsigned_put_body_is_refused(root, tmp_path):
    """A PUT in the unsigned-trailer form is refused before its body is read (allow_unsigned_payload cannot be set
    without TLS: the config refuses it); NIXL OBJ's signed-body PUTs are accepted."""
    process = GatewayProcess(posix_gateway_config(root), tmp_path).start()
    try:
        key = f"dualpath/{uuid.uuid4().hex}"
        headers = {"host": f"127.0.0.1:{process.port}", "x-amz-content-sha256": STREAMING_UNSIGNED_TRAILER,
                   "x-amz-decoded-content-length": "4", "x-amz-trailer": "x-amz-checksum-crc64nvme"}
        headers.update(sign("PUT", f"/{BUCKET}/{key}", "", headers, CLIENT_ACCESS_KEY, CLIENT_SECRET_KEY,
                            "us-east-1"))
        conn = http.client.HTTPConnection("127.0.0.1", process.port, timeout=10)
        try:
            conn.request("PUT", f"/{BUCKET}/{key}", body=b"4\r\nabcd\r\n0\r\n\r\n",
                         headers={**headers, "content-encoding": "aws-chunked"})
            response = conn.getresponse()
            assert response.status == 403 and b"the body&apos;s SHA-256" in response.read().replace(b"'", b"&apos;")
        finally:
            conn.close()
        assert not (root / key).exists()
        written, keys, objects = nixl_obj_writes(process, 14)
        assert written == [True, True] and (root / keys[0]).read_bytes() == objects[0].tobytes()
    finally:
        process.stop()


def test_an_https_gateway_with_another_ca_is_not_trusted(gateway, root, tmp_path):
    """The s3agg store checks the gateway's certificate against gateway_ca_bundle: another CA's file fails the
    TLS handshake, and the read falls back to the bucket's own endpoint (here that same gateway, trusted)."""
    from dualpath_dev.tls import make_server_tls

    keys, objects = sealed_objects(3, seed=12)
    write_with_posix_store(root, keys, objects)
    agent = nixl_agent_for("wrong-ca")
    other_ca = make_server_tls(tmp_path / "other", ["127.0.0.1"]).ca_file
    config = {"backend": "s3agg", "gateway": gateway.url, "s3": s3_section(gateway), "gateway_ca_bundle": str(other_ca)}
    store = make_store(parse_store_config(config), LAYOUT, agent)
    buffers = LayerBuffers(agent, LAYOUT.num_layers, len(keys), LAYOUT.layer_block_bytes + DIGEST_BYTES)
    try:
        result = store.read_layerwise(keys, buffers.addrs, lambda layer: None)
        assert result.mode == "fallback" and "CERTIFICATE_VERIFY_FAILED" in result.error
        integrity, hashes = ChunkIntegrity(LAYOUT), [chunk_hash_of(k) for k in keys]
        assert [integrity.verify_layer_major(hashes, l, buffers.array[l]) for l in range(LAYOUT.num_layers)] == [3] * 4
    finally:
        buffers.close()
        store.close()


# --- the aggregated read over files -------------------------------------------------------------------


def s3agg_store(gateway, agent, delivery: str):
    config = {"backend": "s3agg", "gateway": gateway.url, "s3": {**s3_section(gateway)}, "delivery": delivery,
              "request_timeout_s": 30.0, "gateway_ca_bundle": gateway.ca_bundle}
    return make_store(parse_store_config(config), LAYOUT, agent)


@pytest.mark.parametrize("delivery", ["nixl", "http"])
def test_aggregated_read_of_files_a_posix_store_wrote(gateway, root, delivery):
    keys, objects = sealed_objects(12, seed=3)
    write_with_posix_store(root, keys, objects)
    agent = nixl_agent_for("agg-client")
    store = s3agg_store(gateway, agent, delivery)
    integrity, hashes = ChunkIntegrity(LAYOUT), [chunk_hash_of(k) for k in keys]
    buffers = LayerBuffers(agent, LAYOUT.num_layers, len(keys), LAYOUT.layer_block_bytes + DIGEST_BYTES)
    try:
        handed: list[int] = []
        result = store.read_layerwise(keys, buffers.addrs, handed.append)
        assert result.mode == "layerwise" and handed == list(range(LAYOUT.num_layers))
        full = LAYOUT.full_block_bytes
        for layer in range(LAYOUT.num_layers):
            blocks = buffers.array[layer, : len(keys) * LAYOUT.layer_block_bytes].reshape(len(keys), -1)
            np.testing.assert_array_equal(blocks, objects[:, slice(*LAYOUT.layer_range(layer))])
            digests = buffers.array[layer, len(keys) * LAYOUT.layer_block_bytes:].reshape(len(keys), -1)
            np.testing.assert_array_equal(digests, objects[:, slice(*LAYOUT.digest_range(layer))])
            assert integrity.verify_layer_major(hashes, layer, buffers.array[layer]) == len(keys)
        assert full == LAYOUT.num_layers * LAYOUT.layer_block_bytes
    finally:
        buffers.close()


def test_chunk_major_delivery_into_pool_slots_and_corruption_is_caught_at_the_reader(gateway, root):
    keys, objects = sealed_objects(5, seed=4)
    write_with_posix_store(root, keys, objects)
    agent = nixl_agent_for("agg-pool")
    store = s3agg_store(gateway, agent, "nixl")
    pool = HostBufferPool(agent, LAYOUT.object_bytes, len(keys))
    integrity = ChunkIntegrity(LAYOUT)
    try:
        slots = pool.acquire(len(keys))
        addrs = [pool.slot_addr(s) for s in slots]
        store.read_layerwise(keys, addrs, lambda layer: None, layout=LAYOUT_CHUNK_MAJOR)
        for slot, key, obj in zip(slots, keys, objects):
            np.testing.assert_array_equal(pool.slot_view(slot), obj)
            assert integrity.verify(chunk_hash_of(key), pool.slot_view(slot))
        # Negative control: one byte of chunk 2's layer 1 flipped on disk is delivered as stored and fails there.
        path = root / keys[2]
        data = bytearray(path.read_bytes())
        data[LAYOUT.layer_range(1)[0] + 7] ^= 0x01
        path.write_bytes(bytes(data))
        store.read_layerwise(keys, addrs, lambda layer: None, layout=LAYOUT_CHUNK_MAJOR)
        view = pool.slot_view(slots[2])
        assert not integrity.verify(chunk_hash_of(keys[2]), view)
        layer1 = slice(*LAYOUT.layer_range(1))
        assert not integrity.verify_layer(chunk_hash_of(keys[2]), 1, view[layer1],
                                          view[slice(*LAYOUT.digest_range(1))])
        assert integrity.verify_layer(chunk_hash_of(keys[2]), 0, view[slice(*LAYOUT.layer_range(0))],
                                      view[slice(*LAYOUT.digest_range(0))])
    finally:
        pool.close()


def test_a_short_file_is_refused_naming_it(gateway, root):
    """The POSIX backing stats every chunk file first (no request to anyone): another size is a 400 naming it."""
    keys, objects = sealed_objects(3, seed=6)
    write_with_posix_store(root, keys, objects)
    (root / keys[1]).write_bytes(objects[1][:-DIGEST_BYTES].tobytes())
    agent = nixl_agent_for("agg-short")
    store = s3agg_store(gateway, agent, "nixl")
    buffers = LayerBuffers(agent, LAYOUT.num_layers, len(keys), LAYOUT.layer_block_bytes + DIGEST_BYTES)
    try:
        with pytest.raises(GatewayRefused) as refused:
            store.read_layerwise(keys, buffers.addrs, lambda layer: None)
        assert (refused.value.status, refused.value.code) == (400, "InvalidObjectSize")
        assert f"chunk object {keys[1]} has {LAYOUT.object_bytes - DIGEST_BYTES} bytes" in str(refused.value)
        assert buffers.untouched()
    finally:
        buffers.close()


@pytest.mark.parametrize("delivery", ["nixl", "http"])
def test_strided_delivery_lands_layer_major_in_pool_slots(gateway, root, delivery):
    """A layer-major pool's slots: each layer of the hit one host run, the trailers apart; no reshuffle on NIXL."""
    keys, objects = sealed_objects(4, seed=6)
    write_with_posix_store(root, keys, objects)
    agent = nixl_agent_for(f"agg-strided-{delivery}")
    store = s3agg_store(gateway, agent, delivery)
    pool = HostBufferPool(agent, LAYOUT.object_bytes, 6, layer_major=(LAYOUT.num_layers, LAYOUT.layer_block_bytes))
    integrity = ChunkIntegrity(LAYOUT)
    try:
        pool.array[:] = 0xA5
        slots = pool.acquire(len(keys))
        assert slots == [0, 1, 2, 3]
        handed: list[int] = []
        store.read_layerwise(keys, [pool.slot_addr(s) for s in slots], handed.append, layout=LAYOUT_STRIDED,
                             trailer_addrs=[pool.trailer_addr(s) for s in slots], layer_stride=pool.layer_stride)  # fmt: skip
        assert handed == list(range(LAYOUT.num_layers))
        for slot, key, obj in zip(slots, keys, objects):
            layers = [pool.layer_view(slot, layer) for layer in range(LAYOUT.num_layers)]
            for layer, data in enumerate(layers):
                np.testing.assert_array_equal(data, obj[slice(*LAYOUT.layer_range(layer))])
            np.testing.assert_array_equal(pool.trailer_view(slot), obj[LAYOUT.full_block_bytes :])
            assert integrity.verify_parts(chunk_hash_of(key), layers, pool.trailer_view(slot))
        # Layer 1 of the whole hit is one run: every chunk's Layer Block 1 in chunk order.
        run = pool.array[pool.layer_stride : pool.layer_stride + len(keys) * LAYOUT.layer_block_bytes]
        np.testing.assert_array_equal(run.reshape(len(keys), -1), objects[:, slice(*LAYOUT.layer_range(1))])
        # Whole objects the same way (read_segments), into other slots; slot 4 is left alone.
        again = [5, 4]
        assert store.read_segments(keys[:2], [pool.slot_segments(s) for s in again]) == [True, True]
        np.testing.assert_array_equal(pool.layer_view(5, 2), objects[0][slice(*LAYOUT.layer_range(2))])
        np.testing.assert_array_equal(pool.trailer_view(4), objects[1][LAYOUT.full_block_bytes :])
        # Negative control: a NIXL target whose layers overlap another chunk's is refused before anything moves.
        with pytest.raises(GatewayRefused, match="overlap"):
            store._nixl_request(uuid.uuid4().hex, keys[:2], _Target(
                LAYOUT, LAYOUT_STRIDED, [pool.slot_addr(0), pool.slot_addr(0) + 8], 2,
                [pool.trailer_addr(0), pool.trailer_addr(1)], pool.layer_stride), lambda token: None)
    finally:
        pool.close()
