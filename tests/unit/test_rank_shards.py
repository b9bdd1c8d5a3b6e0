"""Tensor-parallel shards: where each rank's part of a chunk is stored, and what makes a chunk a hit.

Chunk hashes chain from rank 0's namespace (the engine's); each rank keys and
seals its object under its own namespace, and every rank but 0 under the chunk
hash chained with that namespace, so an object copied from one rank's key to
another's fails its integrity check. The scheduler counts a chunk as a hit only
when every rank's shard is stored.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dualpath_connector.config import ChunkGeometry, parse_config
from dualpath_connector.protocol import ProtocolError, RankKeySpace, StoreKeySpace
from dualpath_connector.scheduler.scheduler import DualPathScheduler
from nixl_backends.integrity import ChunkIntegrity, chunk_hash_of
from nixl_backends.layout import chunk_hashes
from tests.unit.test_scheduler import (
    BLOCK,
    CHUNK,
    KEY_PREFIX,
    NAMESPACE,
    FakeStore,
    InlineExecutor,
    make_request,
    prompt_of,
)

SHARDS = [dataclasses.replace(NAMESPACE, tp_size=2, tp_rank=rank) for rank in range(2)]


def hashes_of(tokens: list[int]) -> list[str]:
    return chunk_hashes(SHARDS[0].digest(), tokens, CHUNK)


def rank_space(rank: int) -> RankKeySpace:
    return RankKeySpace.of_rank(SHARDS[rank], SHARDS[0], KEY_PREFIX)


def test_rank_0_keeps_the_engine_keys_other_ranks_get_their_own_namespace_and_hash():
    engine = StoreKeySpace.of(SHARDS[0], KEY_PREFIX)
    chunk = hashes_of(prompt_of(CHUNK))[0]
    assert rank_space(0).key(chunk) == engine.key(chunk)
    assert rank_space(0).object_hash(chunk) == chunk
    key = rank_space(1).key(chunk)
    assert SHARDS[1].digest() in key and SHARDS[0].digest() not in key
    assert chunk_hash_of(key) == rank_space(1).object_hash(chunk) != chunk
    # Chains from the engine's namespace: token ids name the same chunk on every rank.
    assert rank_space(1).chunk_keys(prompt_of(CHUNK)) == [key]


def test_a_shard_copied_to_another_ranks_key_fails_its_integrity_check():
    integrity = ChunkIntegrity(rank_space(0).layout)
    chunk = hashes_of(prompt_of(CHUNK))[0]
    obj = np.random.default_rng(0).integers(0, 255, rank_space(0).layout.object_bytes, dtype=np.uint8)
    integrity.seal(rank_space(0).object_hash(chunk), obj)
    assert integrity.verify(rank_space(0).object_hash(chunk), obj)
    assert not integrity.verify(rank_space(1).object_hash(chunk), obj)


@pytest.fixture
def two_rank_scheduler(tmp_path):
    raw = {"store": {"backend": "posix", "root": str(tmp_path)}, "key_prefix": KEY_PREFIX}
    store, now = FakeStore(), [0.0]
    scheduler = DualPathScheduler(
        parse_config(raw), "kv_both", ChunkGeometry(block_size=BLOCK, chunk_tokens=CHUNK), SHARDS[0], store,
        shards=SHARDS, lookup_executor=InlineExecutor(), clock=lambda: now[0],
    )  # fmt: skip
    return scheduler, store, now


def test_a_chunk_is_a_hit_only_when_every_rank_stored_its_shard(two_rank_scheduler):
    scheduler, store, now = two_rank_scheduler
    prompt = prompt_of(4 * CHUNK + 5)
    chunks = hashes_of(prompt)
    # Rank 0 stored all four chunks, rank 1 only the first two.
    store.present.update(rank_space(0).key(h) for h in chunks)
    store.present.update(rank_space(1).key(h) for h in chunks[:2])
    assert scheduler.get_num_new_matched_tokens(make_request("r1", prompt), 0) == (2 * CHUNK, True)
    # Rank 1's last two land, and the absent answer expires: the whole run is a hit.
    store.present.update(rank_space(1).key(h) for h in chunks[2:])
    now[0] += scheduler.config.lookup_absent_ttl_s + 1
    assert scheduler.get_num_new_matched_tokens(make_request("r2", prompt), 0) == (4 * CHUNK, True)


def test_an_engine_exports_every_shard_and_a_reader_gets_them_rank_0_first():
    engine = StoreKeySpace.of(SHARDS[0], KEY_PREFIX)
    labels = {**engine.to_labels(), "shard_namespaces": ",".join(n.digest() for n in SHARDS)}
    sharded = StoreKeySpace.from_labels(labels)
    assert sharded.keys_per_chunk == 2 and [s.digest for s in sharded.shards] == [n.digest() for n in SHARDS]
    chunk = hashes_of(prompt_of(CHUNK))[0]
    assert sharded.chunk_keys(prompt_of(CHUNK)) == [rank_space(0).key(chunk), rank_space(1).key(chunk)]
    # One shard (a one-rank or MLA engine, or an engine that predates the label): the plain key space.
    assert StoreKeySpace.from_labels({**engine.to_labels(), "shard_namespaces": engine.digest}) == engine
    assert StoreKeySpace.from_labels(engine.to_labels()) == engine
    for bad in (f"{SHARDS[1].digest()},{engine.digest}", f"{engine.digest},NOT-HEX"):
        with pytest.raises(ProtocolError):
            StoreKeySpace.from_labels({**engine.to_labels(), "shard_namespaces": bad})
