"""vLLM's CPU build with LMCache's ``LMCacheMPConnector`` and an ``lmcache server`` whose L2 is our S3 adapter
(nixl_backends.lmcache_l2) on SeaweedFS.

A prompt is served cold (LMCache stores its chunks in L1 and, through our adapter, in the bucket); the
server's L1 is cleared and vLLM's own prefix cache reset, so the same prompt's hit can only come from our
L2; its greedy tokens and logprobs must equal those of an engine without any cache. The negative control
writes one chunk's payload over another's (resealed as the overwritten object is sealed, which the
checksum mode cannot tell apart) and the same comparison must then fail: so the hit really came from the bucket, and
the comparison can fail. The control changes *what* is loaded, not only where: a rotation of the prompt's own
chunks among their keys would hand attention the same (K, V) pairs, RoPE positions baked into K, in other
slots, and the uncached tail's attention over the same set is the same sum (up to rounding order).
"""

from __future__ import annotations

import json
import os
import random
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from dualpath_dev.processes import ServiceProcess, free_port  # noqa: E402
from nixl_backends.lmcache_names import Family, family_key, listed_key  # noqa: E402
from tests.conftest import PLAIN_ENGINE_BATCH_TOKENS, poll, resealed, same  # noqa: E402
from tests.vllm_engine import Engine  # noqa: E402

pytestmark = pytest.mark.engine

LMCACHE_CHUNK = 256
MAX_TOKENS = 24
PREFIX = "lmcache"
_rng = random.Random(4321)
# 4 full LMCache chunks (1024 tokens) and a tail: the hit is 1024 tokens, a multiple of vLLM's step of 512
# (max_num_batched_tokens), so the hit run computes its tail in the same step as a cold run does and the
# outputs must be identical, not merely close.
PROMPT = [_rng.randrange(1024) for _ in range(1100)]
CHUNKS = len(PROMPT) // LMCACHE_CHUNK


class LMCacheServer(ServiceProcess):
    """``lmcache server`` (MP mode) with our L2 adapter; stopped by its PID."""

    stop_grace_s = 5.0  # it closes the adapter on SIGTERM within a second; more is a hang

    def __init__(self, adapter_params: dict, log_path: Path, env: dict[str, str]) -> None:
        self.port, http_port = free_port(), free_port()
        spec = {"type": "plugin", "module_path": "nixl_backends.lmcache_l2", "class_name": "DualPathL2Adapter",
                "adapter_params": adapter_params}  # fmt: skip
        lmcache = str(Path(sys.executable).with_name("lmcache"))
        self.args = [
            lmcache, "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--http-host", "127.0.0.1", "--http-port", str(http_port), "--chunk-size", str(LMCACHE_CHUNK),
            "--l1-size-gb", "0.2", "--no-l1-use-lazy", "--eviction-policy", "LRU",
            # vLLM's CPU KV tensors resolve the connector's transfer mode to engine_driven.
            "--supported-transfer-mode", "engine_driven", "--l2-adapter", json.dumps(spec),
        ]  # fmt: skip
        self.env = env
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{http_port}"
        self.health_url = f"{self.base_url}/healthcheck"

    def clear_l1(self) -> None:
        request = urllib.request.Request(f"{self.base_url}/cache/clear", b'{"tier": "l1"}',
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["status"] == "ok"


@pytest.fixture
def lmcache_stack(tiny_model, seaweedfs, s3_bucket, tmp_path):
    env = {**os.environ, "AWS_ACCESS_KEY_ID": seaweedfs.access_key,
           "AWS_SECRET_ACCESS_KEY": seaweedfs.secret_key, "LMCACHE_DISABLE_BANNER": "1"}  # fmt: skip
    store = {"backend": "s3", "endpoint": seaweedfs.endpoint, "bucket": s3_bucket}
    server = LMCacheServer({"store": store, "key_prefix": PREFIX}, tmp_path / "lmcache-server.log", env)
    server.start(timeout_s=180)
    try:
        kv_config = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port},
        }
        # Its own processes: vLLM's CPU worker, started in a process that has imported LMCache's
        # connector, fails rebinding Triton kernels ("'_lib_fn_wrapper' object has no attribute 'get'").
        with Engine(tiny_model, kv_config, one_process=False,
                    max_num_batched_tokens=PLAIN_ENGINE_BATCH_TOKENS) as engine:
            yield server, engine, s3_bucket
    finally:
        server.stop()


def _stored(seaweedfs, bucket: str) -> list[str]:
    """The chunk objects in the bucket (not the adapter's family records)."""
    listing = seaweedfs.client().list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/")
    records = family_key(PREFIX, "")
    return sorted(item["Key"] for item in listing.get("Contents", []) if not item["Key"].startswith(records))


def _seal(s3, bucket: str, name: str) -> str:
    """The hash the adapter sealed object ``name`` with (its family's record says how it was named)."""
    namespace = name.split("/")[1]
    record = s3.get_object(Bucket=bucket, Key=family_key(PREFIX, namespace))["Body"].read()
    return listed_key(Family.from_record(record, namespace), name).seal


def test_hit_from_our_l2_matches_no_cache_and_a_duplicated_chunk_does_not(plain_engine, seaweedfs, lmcache_stack):
    baseline = plain_engine.generate([PROMPT], MAX_TOKENS)[0]
    server, engine, bucket = lmcache_stack

    cold = engine.generate([PROMPT], MAX_TOKENS)[0]
    assert cold["num_cached_tokens"] == 0
    assert same(cold, baseline)
    names = poll(lambda: _stored(seaweedfs, bucket), lambda got: len(got) >= CHUNKS, 120,
                 "chunks stored in the bucket by the L2 adapter")  # fmt: skip
    assert len(names) == CHUNKS  # only the prompt's full chunks

    # L1 cleared and vLLM's prefix cache reset: the hit can only come from the bucket.
    server.clear_l1()
    hit = engine.generate([PROMPT], MAX_TOKENS)[0]
    assert hit["num_cached_tokens"] == CHUNKS * LMCACHE_CHUNK
    assert same(hit, baseline), "KV loaded through the L2 adapter changed the output"

    # Negative control: one chunk's payload written over another's key and resealed for it, so the loaded
    # KV holds the first chunk's keys and values twice and the second's not at all.
    s3 = seaweedfs.client()
    source, target = names[0], names[1]
    body = s3.get_object(Bucket=bucket, Key=source)["Body"].read()
    s3.put_object(Bucket=bucket, Key=target, Body=resealed(body, _seal(s3, bucket, target), num_layers=1))
    server.clear_l1()
    wrong = engine.generate([PROMPT], MAX_TOKENS)[0]
    assert wrong["num_cached_tokens"] == CHUNKS * LMCACHE_CHUNK  # the forged chunk was served
    assert not same(wrong, baseline), "a duplicated chunk's KV went unnoticed: the comparison cannot fail"
