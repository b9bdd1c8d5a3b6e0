"""Tensor parallelism (TP = 2) on vLLM's CPU build (gloo, the mp executor), one engine (``kv_both``).

Each rank saves and loads its own shard of every chunk (its KV heads) under its own namespace; chunk hashes
chain from rank 0's namespace (the engine's), and rank 1 keys its shard under the hash chained once more with
its own namespace; a chunk is a hit when both shards are stored. A fresh engine with the connector and an empty prefix cache must answer A (P and a
suffix) exactly as an engine without the connector at the same TP answers it after P (its own prefix-cache
hit). Negative control: rank 1's shard of one chunk replaced by its shard of another chunk, resealed with a
valid checksum trailer: the loaded set of keys and values changes on one rank only, and the answer must
change (so rank 1's shard is really loaded, and the comparison can fail).
"""

from __future__ import annotations

import random

import pytest

from dualpath_dev.tiny_model import TINY_LLAMA
from nixl_backends.layout import chunk_hashes, chunk_key, shard_chunk_hash
from tests.conftest import PLAIN_ENGINE_BATCH_TOKENS, poll, resealed, same
from tests.vllm_engine import Engine

pytestmark = pytest.mark.engine

TP = 2
CHUNK = 32
MAX_TOKENS = 24
_rng = random.Random(2024)
P = [_rng.randrange(1024) for _ in range(1500)]
A = P + [_rng.randrange(1024) for _ in range(40)]
HIT = len(P) // CHUNK * CHUNK


def dualpath(root) -> dict:
    return {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "dualpath_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": {"backend": "posix", "root": str(root)}},
    }


@pytest.fixture(scope="module")
def baseline(tiny_model) -> dict:
    """An engine without the connector at the same TP: A after P (its own prefix-cache hit of P's chunks)."""
    with Engine(tiny_model, tensor_parallel_size=TP, max_num_batched_tokens=PLAIN_ENGINE_BATCH_TOKENS) as plain:
        plain.generate([P], MAX_TOKENS)
        out = plain.generate([A], MAX_TOKENS, reset_prefix_cache=False)[0]
    assert out["num_cached_tokens"] == HIT
    return out


def test_each_rank_stores_and_loads_its_shard_and_the_answer_matches(tiny_model, tmp_path, baseline):
    config = dualpath(tmp_path)
    with Engine(tiny_model, config, tensor_parallel_size=TP, max_num_batched_tokens=PLAIN_ENGINE_BATCH_TOKENS) as engine:
        namespaces, prefix = engine.ready["namespaces"], engine.ready["key_prefix"]
        assert len(set(namespaces)) == TP  # a namespace per rank: no rank writes another's object

        def object_hash(rank: int, chunk: int) -> str:
            engine_hash = chunk_hashes(namespaces[0], P, CHUNK)[chunk]
            return shard_chunk_hash(namespaces[rank], engine_hash) if rank else engine_hash

        def path(rank: int, chunk: int):
            return tmp_path / chunk_key(prefix, namespaces[rank], object_hash(rank, chunk))

        engine.generate([P], MAX_TOKENS)
        chunks = len(P) // CHUNK
        poll(lambda: sum(path(r, c).exists() for r in range(TP) for c in range(chunks)),
             lambda n: n == TP * chunks, 120, "every rank's chunks of P")  # fmt: skip

        out = engine.generate([A], MAX_TOKENS)[0]  # the prefix cache is reset: the hit comes from the store
        assert out["num_cached_tokens"] == HIT
        assert same(out, baseline), "KV loaded shard by shard changed the output"

        original = path(1, 5).read_bytes()
        path(1, 5).write_bytes(resealed(path(1, 4).read_bytes(), object_hash(1, 5), TINY_LLAMA["num_hidden_layers"]))
        try:
            wrong = engine.generate([A], MAX_TOKENS)[0]
        finally:
            path(1, 5).write_bytes(original)
        assert wrong["num_cached_tokens"] > 6 * CHUNK  # the forged shard (chunk 5) was served
        assert not same(wrong, baseline), "rank 1's forged shard went unnoticed: the comparison cannot fail"
