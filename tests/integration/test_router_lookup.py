"""Hit length from a real S3 store (SeaweedFS): leading run, the last token, object size, outages.

The last test runs the router process with the store and a stand-in engine
that exports ``dualpath_kv:store_namespace_info`` (``namespace: auto``).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from nixl_backends.layout import chunk_hashes, chunk_key, isolated_chain
from nixl_backends.registry import parse_store_config

from dualpath_connector.protocol import PrefillRequest, StoreKeySpace
from dualpath_dev.processes import free_port
from dualpath_router.lookup import HitLookup
from tests.integration.test_router_http import MODEL, engines, router_config, start_router  # noqa: F401 (fixtures)

NAMESPACE = StoreKeySpace(digest="0123abcd" * 4, key_prefix="dualpath", chunk_tokens=32, num_layers=4,
                           layer_block_bytes=1024)
# A stored chunk: its Full Block and the integrity trailer after it.
OBJECT_BYTES = NAMESPACE.layout.object_bytes
TOKENS = list(range(800, 800 + 5 * 32))  # five chunks, ids in the router's vocabulary


@pytest.fixture
def s3_env(seaweedfs, monkeypatch):
    """Credentials through the AWS chain, as the router requires."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.secret_key)
    return seaweedfs


def keys_of(tokens: list[int], cache_salt: str | None = None) -> list[str]:
    hashes = chunk_hashes(isolated_chain(NAMESPACE.digest, cache_salt=cache_salt), tokens, NAMESPACE.chunk_tokens)
    return [chunk_key(NAMESPACE.key_prefix, NAMESPACE.digest, h) for h in hashes]


def store_section(seaweedfs, bucket: str) -> dict:
    return {"backend": "s3", "endpoint": seaweedfs.endpoint, "bucket": bucket, "addressing_style": "path"}


def put_chunks(seaweedfs, bucket: str, keys: list[str], size: int = OBJECT_BYTES) -> None:
    client = seaweedfs.client()
    if bucket not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=bucket)
    for key in keys:
        client.put_object(Bucket=bucket, Key=key, Body=b"\0" * size)


def lookup_for(seaweedfs, bucket: str) -> HitLookup:
    lookup = HitLookup(parse_store_config(store_section(seaweedfs, bucket)), cache_chunks=1000)
    lookup.namespace = NAMESPACE
    return lookup


def test_leading_run_and_never_the_last_token(s3_env, s3_bucket):
    keys = keys_of(TOKENS)
    put_chunks(s3_env, s3_bucket, keys[:4])
    lookup = lookup_for(s3_env, s3_bucket)
    hit = lambda tokens: asyncio.run(lookup.hit_tokens(tokens))  # noqa: E731
    # 4 x 32 tokens stored. A 128-token prompt may claim only 3 chunks: the last token is always computed.
    assert hit(TOKENS[:128]) == 96
    assert hit(TOKENS[:129]) == 128
    assert hit(TOKENS) == 128  # chunk 4 is missing
    assert hit(TOKENS[:32]) == 0
    # A different first chunk changes every hash after it.
    assert hit([7] + TOKENS[1:129]) == 0


def test_a_tp_engines_chunk_counts_only_once_every_ranks_shard_is_stored(s3_env, s3_bucket):
    labels = {**NAMESPACE.to_labels(), "shard_namespaces": f"{NAMESPACE.digest},{'4567cdef' * 4}"}
    sharded = StoreKeySpace.from_labels(labels)  # as the router reads it from a TP=2 engine's metrics
    rank0, rank1 = sharded.shards
    hashes = chunk_hashes(NAMESPACE.digest, TOKENS, NAMESPACE.chunk_tokens)
    put_chunks(s3_env, s3_bucket, [rank0.key(h) for h in hashes[:4]] + [rank1.key(h) for h in hashes[:2]])
    lookup = lookup_for(s3_env, s3_bucket)
    lookup.namespace = sharded
    assert asyncio.run(lookup.hit_tokens(TOKENS)) == 64  # rank 1 stored two chunks of four
    lookup.namespace = NAMESPACE  # rank 0's keys alone (a configured namespace): all four
    assert asyncio.run(lookup.hit_tokens(TOKENS)) == 128


def test_gap_and_short_objects_end_the_run(s3_env, s3_bucket):
    keys = keys_of(TOKENS)
    put_chunks(s3_env, s3_bucket, [keys[0], keys[2], keys[3]])
    put_chunks(s3_env, s3_bucket, [keys[1]], size=OBJECT_BYTES - 1)  # a torn write
    assert asyncio.run(lookup_for(s3_env, s3_bucket).hit_tokens(TOKENS)) == 32


def test_positive_answers_are_cached(s3_env, s3_bucket):
    keys = keys_of(TOKENS)
    put_chunks(s3_env, s3_bucket, keys[:2])
    lookup = lookup_for(s3_env, s3_bucket)
    assert asyncio.run(lookup.hit_tokens(TOKENS)) == 64
    s3_env.client().delete_object(Bucket=s3_bucket, Key=keys[0])
    # Chunks are immutable: the router does not ask again for what it saw present.
    assert asyncio.run(lookup.hit_tokens(TOKENS)) == 64


def test_salted_prompts_hit_only_their_own_salts_chunks(s3_env, s3_bucket):
    """A salt is looked up in its own chain: unsalted or other salts' chunks of the same tokens are no hit."""
    put_chunks(s3_env, s3_bucket, keys_of(TOKENS)[:4] + keys_of(TOKENS, "tenant-a")[:2])
    lookup = lookup_for(s3_env, s3_bucket)
    assert asyncio.run(lookup.hit_tokens(TOKENS)) == 128
    assert asyncio.run(lookup.hit_tokens(TOKENS, "tenant-a")) == 64
    assert asyncio.run(lookup.hit_tokens(TOKENS, "tenant-b")) == 0
    # The remembered positives are per key, so also per salt: asked again, the answers stand.
    assert asyncio.run(lookup.hit_tokens(TOKENS, "tenant-b")) == 0
    assert asyncio.run(lookup.hit_tokens(TOKENS, "tenant-a")) == 64


def test_store_outage_is_a_miss(monkeypatch, caplog):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    config = parse_store_config({"backend": "s3", "endpoint": f"http://127.0.0.1:{free_port()}",
                                 "bucket": "nobody-home", "create_bucket": False})
    lookup = HitLookup(config, cache_chunks=10)
    lookup.namespace = NAMESPACE
    assert asyncio.run(lookup.hit_tokens(TOKENS)) == 0
    assert asyncio.run(lookup.hit_tokens(TOKENS)) == 0
    assert len([r for r in caplog.records if "store lookup failed" in r.message]) == 1  # rate-limited


def test_router_reports_hits_with_namespace_from_engine_metrics(s3_env, s3_bucket, engines, start_router,  # noqa: F811
                                                                monkeypatch):
    put_chunks(s3_env, s3_bucket, keys_of(TOKENS)[:3])
    pe, de = engines("pe0", "prefill"), engines("de0", "decode")
    pe.metrics_text += (
        "# TYPE dualpath_kv:store_namespace_info gauge\n"
        f'dualpath_kv:store_namespace_info{{namespace="{NAMESPACE.digest}",key_prefix="dualpath",'
        f'chunk_tokens="32",num_layers="4",layer_block_bytes="1024",model_name="{MODEL}",engine="0"}} 1\n'
    )
    config = router_config([pe], [de], store=store_section(s3_env, s3_bucket), read_side="pe")
    router = start_router(config)  # inherits the AWS_* variables set by s3_env
    expected = 96
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the namespace arrives with the first scrape
        response = httpx.post(f"{router.url}/v1/completions",
                              json={"model": MODEL, "prompt": TOKENS[:129], "max_tokens": 1}, timeout=30.0)
        assert response.status_code == 200
        if response.headers["x-dualpath-hit-tokens"] == str(expected):
            break
    assert response.headers["x-dualpath-hit-tokens"] == str(expected)
    salted = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": TOKENS[:129],
                                                                "max_tokens": 1, "cache_salt": "tenant-a"}, timeout=30.0)
    assert salted.status_code == 200 and salted.headers["x-dualpath-hit-tokens"] == "0"
    assert pe.received[-1]["cache_salt"] == "tenant-a"  # the engines store and load it in the salt's chain
    # Read side forced to "pe": the PE reads every hit and is told of no DE to move reads to.
    assert PrefillRequest.from_dict(pe.received[-1]["kv_transfer_params"]) == PrefillRequest("pe")
    assert "AWS_SECRET_ACCESS_KEY" not in router.log() and s3_env.secret_key not in router.log()
