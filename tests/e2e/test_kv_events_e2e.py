"""vLLM KV events for the store, end to end: a real vLLM CPU engine publishing over ZMQ, the store in SeaweedFS.

A subscriber decodes vLLM's msgpack batches with vLLM's own classes. The
engine stores two prompts' chunks: ``BlockStored`` with medium ``STORAGE``
must come for exactly the chunks in the bucket, each only once its object
exists, carrying the block hashes vLLM's own GPU-tier events carry for the
same blocks and the prompt's token ids. Then ``dualpath-kv gc`` (its own
process) deletes them and ``BlockRemoved`` (``STORAGE``) must come for the same
blocks. The two prompts differ in one token of their first block, so every
hash differs between them: a mix-up of hashes could not pass.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from dualpath_connector.metrics.kv_events import OWNERSHIP
from dualpath_dev.processes import free_port
from nixl_backends.layout import chunk_hashes, chunk_key
from nixl_backends.removals import RECORDS_DIR
from tests.vllm_engine import Engine

pytestmark = pytest.mark.engine

BLOCK = 32  # vLLM's CPU block size; chunk_tokens defaults to it
_rng = random.Random(1717)
PROMPT = [_rng.randrange(3, 1024) for _ in range(200)]  # 6 full blocks and a tail
OTHER = PROMPT[:31] + [(PROMPT[31] + 1) % 1024] + PROMPT[32:]  # differs in block 0
EVENT_TIMEOUT_S = 120


class Subscriber:
    """vLLM's ZMQ KV-event stream, decoded with vLLM's own msgspec classes."""

    def __init__(self, endpoint: str) -> None:
        # vLLM's publisher binds a wildcard endpoint and connects to any other, as to an
        # indexer listening there (llm-d's global-socket mode): this one listens on loopback.
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.bind(endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def drain(self, wait_ms: int) -> None:
        while self._socket.poll(wait_ms):
            _topic, _seq, payload = self._socket.recv_multipart()
            self.events.extend(self._decoder.decode(payload).events)
            wait_ms = 0

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def storage(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind) and e.medium == "STORAGE"]


def by_parent_and_tokens(events: list, medium: str) -> dict[tuple, object]:
    """(parent hash, a block's token ids) -> that block's hash, from BlockStored events of ``medium``.

    Blocks with equal tokens under different prefixes differ in their parent, so this names each block once.
    """
    blocks = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                blocks[(parent, tuple(event.token_ids[i * event.block_size : (i + 1) * event.block_size]))] = block_hash
                parent = block_hash
    return blocks


def chain(blocks: dict[tuple, object], prompt: list[int]) -> list:
    """The hashes of ``prompt``'s full blocks, block after block; KeyError if one is missing."""
    hashes, parent = [], None
    for i in range(len(prompt) // BLOCK):
        parent = blocks[(parent, tuple(prompt[i * BLOCK : (i + 1) * BLOCK]))]
        hashes.append(parent)
    return hashes


@pytest.fixture(scope="module")
def bucket(seaweedfs):
    name = f"kv-events-{uuid.uuid4().hex[:8]}"
    yield name
    client = seaweedfs.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for item in page.get("Contents", ()):
            client.delete_object(Bucket=name, Key=item["Key"])
    client.delete_bucket(Bucket=name)


@pytest.fixture(scope="module")
def engine_and_events(tiny_model, seaweedfs, bucket):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    kv_config = {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "dualpath_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store": {"backend": "s3", "endpoint": seaweedfs.endpoint, "bucket": bucket},
            "kv_events_gc_poll_s": 0.5,
        },
    }
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    subscriber = Subscriber(endpoint)
    try:
        with Engine(tiny_model, kv_config, s3=seaweedfs, kv_events_config=json.dumps(events_config)) as engine:
            # The publisher's connection and the subscription settle after start-up: each
            # reset publishes AllBlocksCleared with the next step; the first one seen proves it.
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            while not any(isinstance(e, AllBlocksCleared) for e in subscriber.events):
                assert time.monotonic() < deadline, "no KV event batch reached the subscriber"
                engine.generate([[5, 6, 7]], 1, reset_prefix_cache=True)
                subscriber.drain(500)
            subscriber.events.clear()
            yield engine, subscriber
    finally:
        subscriber.close()


def drive_until(engine: Engine, subscriber: Subscriber, done, what: str) -> None:
    """Steps the idle engine with one-token requests (no full block: nothing stored) until ``done()``."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while True:
        subscriber.drain(200)
        if done():
            return
        assert time.monotonic() < deadline, f"{what}: got {subscriber.events!r}"
        engine.generate([[5, 6, 7]], 1, reset_prefix_cache=False)


def test_stored_then_removed_chunks_are_announced_with_vllms_block_hashes(engine_and_events, seaweedfs, bucket):
    engine, subscriber = engine_and_events
    namespace, prefix = engine.ready["namespace"], engine.ready["key_prefix"]
    s3 = seaweedfs.client()
    prompts = {"PROMPT": PROMPT, "OTHER": OTHER}
    expected_chunks = {chunk_key(prefix, namespace, h)
                       for p in prompts.values() for h in chunk_hashes(namespace, p, BLOCK)}  # fmt: skip
    assert len(expected_chunks) == 12

    engine.generate(list(prompts.values()), 1, reset_prefix_cache=False)
    # vLLM's own GPU-tier events name the blocks (published with the step that computed them).
    gpu_blocks = lambda: len(by_parent_and_tokens(subscriber.events, "GPU"))  # noqa: E731
    drive_until(engine, subscriber, lambda: gpu_blocks() >= 12, "GPU BlockStored")
    gpu = by_parent_and_tokens(subscriber.events, "GPU")
    gpu_chains = {name: chain(gpu, prompt) for name, prompt in prompts.items()}
    key_of = {h: chunk_key(prefix, namespace, c) for name, prompt in prompts.items()
              for h, c in zip(gpu_chains[name], chunk_hashes(namespace, prompt, BLOCK))}  # fmt: skip
    # The negative control: the prompts differ in one token of block 0, so every block hash differs.
    assert set(gpu_chains["PROMPT"]).isdisjoint(gpu_chains["OTHER"]) and len(key_of) == 12

    checked: set = set()

    def all_stored() -> bool:
        for event in storage(subscriber.events, BlockStored):
            if event.block_hashes[0] not in checked:
                # Durable before announced: the chunk's object exists once its event is seen.
                s3.head_object(Bucket=bucket, Key=key_of[event.block_hashes[0]])
                checked.add(event.block_hashes[0])
        return len(storage(subscriber.events, BlockStored)) >= 12

    drive_until(engine, subscriber, all_stored, "BlockStored (STORAGE) for 12 blocks")

    # Exactly the chunks in the bucket, each announced once, per vLLM block, with vLLM's hashes and the tokens.
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/{namespace}/")
    in_bucket = {item["Key"] for page in pages for item in page.get("Contents", ())}
    assert in_bucket == expected_chunks == set(key_of.values())
    stored = storage(subscriber.events, BlockStored)
    assert len(stored) == 12 and all(len(e.block_hashes) == 1 for e in stored)
    assert all((e.block_size, e.lora_id, e.lora_name) == (BLOCK, None, None) for e in stored)
    # Tagged as vLLM's own storage tiers tag theirs: a bucket is REMOTE. vLLM's GPU-tier events, decoded by the same
    # subscriber, carry no locality or ownership: the fields come from the connector, not from the decoding.
    assert {(e.locality, e.ownership, e.kv_cache_spec_kind) for e in stored} == {("REMOTE", OWNERSHIP, "full_attention")}
    gpu_events = [e for e in subscriber.events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert gpu_events and {(e.locality, e.ownership) for e in gpu_events} == {(None, None)}
    storage_blocks = by_parent_and_tokens(stored, "STORAGE")
    for name, prompt in prompts.items():
        assert chain(storage_blocks, prompt) == gpu_chains[name]
    assert not storage(subscriber.events, BlockRemoved)

    # gc, its own process, deletes every chunk of the namespace and records it.
    store = json.dumps({"backend": "s3", "endpoint": seaweedfs.endpoint, "bucket": bucket})
    env = dict(os.environ, AWS_ACCESS_KEY_ID=seaweedfs.access_key, AWS_SECRET_ACCESS_KEY=seaweedfs.secret_key)
    done = subprocess.run(
        [sys.executable, "-m", "dualpath_connector.cli", "gc", "--store", store, "--key-prefix", prefix,
         "--namespace", namespace, "--max-bytes", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/{namespace}/")
    left = {item["Key"] for page in pages for item in page.get("Contents", ())}
    assert left and all(f"/{RECORDS_DIR}/" in key for key in left)

    def removed_blocks() -> list:
        return [h for e in storage(subscriber.events, BlockRemoved) for h in e.block_hashes]

    drive_until(engine, subscriber, lambda: len(removed_blocks()) >= 12, "BlockRemoved (STORAGE) for 12 blocks")
    assert sorted(removed_blocks()) == sorted(key_of)
    assert {(e.locality, e.ownership) for e in storage(subscriber.events, BlockRemoved)} == {("REMOTE", OWNERSHIP)}
