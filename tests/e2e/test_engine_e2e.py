"""End to end on vLLM's CPU build: engines in their own processes, KV in a real S3 server.

The tiny Llama has a large init scale, so a wrong KV cache changes the greedy
tokens or their logprobs; the negative control proves the comparison can fail.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest

from dualpath_dev.tiny_model import TINY_LLAMA
from nixl_backends.dualblade.bind_map import BindMap
from nixl_backends.buffers import align_up
from nixl_backends.dualblade.store import JOURNAL
from nixl_backends.layout import BlockLayout, chunk_hashes, chunk_key, isolated_chain
from nixl_backends.lookup import wait_stored
from nixl_backends.s3_endpoint import object_size
from tests.conftest import poll, resealed, same
from tests.lora_adapter import write_lora_adapter
from tests.vllm_engine import Engine, start_engine_expecting_failure

pytestmark = pytest.mark.engine

CHUNK = 32  # chunk_tokens defaults to vLLM's block_size, 32 on CPU
MAX_TOKENS = 40  # decoding crosses a chunk boundary, so decode chunks are saved too
BUCKET = "dualpath-e2e"
# A stored chunk of the tiny Llama: per layer, K and V of 32 tokens x 2 KV heads x 64, bf16.
LAYOUT = BlockLayout(TINY_LLAMA["num_hidden_layers"],
                     2 * CHUNK * TINY_LLAMA["num_key_value_heads"] * TINY_LLAMA["head_dim"] * 2)  # fmt: skip

_rng = random.Random(1234)
# Longer than max_num_batched_tokens (512): prefill is chunked over several steps.
P = [_rng.randrange(1024) for _ in range(1500)]
A = P + [_rng.randrange(1024) for _ in range(40)]
SHARED = [_rng.randrange(1024) for _ in range(700)]
BATCH = [SHARED + [_rng.randrange(1024) for _ in range(50)] for _ in range(3)]
SALTED = [_rng.randrange(1024) for _ in range(600)]


def kv_config(server, bucket: str = BUCKET, **extra) -> dict:
    return {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "dualpath_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # Credentials reach the engine through the AWS variables (Engine's env).
        "kv_connector_extra_config": {"store": server.bucket_section(bucket), **extra},
    }


# Why the baselines below replay the same history: on vLLM's CPU kernels the
# KV of a token depends, in its last bits, on how prefill was chunked around
# it, and the tiny model amplifies those bits. KV loaded from the store must
# equal what vLLM's own prefix cache would hold, so each comparison is against
# an engine without the connector that computed the same chunks in the same
# steps: its own prefix-cache hit, or a cold run whose chunking a hit at token
# 512 (= max_num_batched_tokens) reproduces exactly.
BOUNDARY_CHUNK = 512 // CHUNK
# Requests loading asynchronously may join decode batches at other steps than
# in the baseline; batches are compared with this bound on logprobs (a wrong
# KV cache moves them by 0.05-0.5), single requests exactly. Within a batch
# only the first token is compared: it is computed from the loaded KV alone,
# while later tokens also carry the batch's rounding, which can flip a near
# tie further on (seen once in a full run after the loads moved to their own core).
BATCH_LOGPROB_TOLERANCE = 1e-2


def first_token(out: dict) -> dict:
    return {"tokens": out["tokens"][:1], "logprobs": out["logprobs"][:1]}


@pytest.fixture(scope="module")
def s3(seaweedfs):
    return seaweedfs.client()


@pytest.fixture(scope="module")
def baseline(plain_engine):
    """Outputs of an engine without the connector, in the histories described above."""
    engine = plain_engine
    out = {"P": engine.generate([P], MAX_TOKENS)[0]}
    out["A_after_P"] = engine.generate([A], MAX_TOKENS, reset_prefix_cache=False)[0]
    assert out["A_after_P"]["num_cached_tokens"] == len(P) // CHUNK * CHUNK
    out["A"] = engine.generate([A], MAX_TOKENS)[0]
    out["S0"] = engine.generate([BATCH[0]], MAX_TOKENS)[0]
    out["BATCH_after_S0"] = engine.generate(BATCH, MAX_TOKENS, reset_prefix_cache=False)
    engine.generate([BATCH[0]], MAX_TOKENS)
    out["S1_after_S0"] = engine.generate([BATCH[1]], MAX_TOKENS, reset_prefix_cache=False)[0]
    out["S2"] = engine.generate([BATCH[2]], MAX_TOKENS)[0]
    return out


@pytest.fixture(scope="module")
def populated(tiny_model, seaweedfs, baseline):
    """A first engine serves P and one prompt of the batch; the connector stores their chunks."""
    with Engine(tiny_model, kv_config(seaweedfs), s3=seaweedfs) as engine:
        outputs = {"P": engine.generate([P], MAX_TOKENS)[0], "S": engine.generate([BATCH[0]], MAX_TOKENS)[0]}
        namespace, prefix = engine.ready["namespace"], engine.ready["key_prefix"]

    def hashes(tokens: list[int]) -> list[str]:
        return chunk_hashes(namespace, tokens, CHUNK)

    return {"outputs": outputs, "hashes": hashes, "key": lambda tokens, i: chunk_key(prefix, namespace, hashes(tokens)[i])}


def test_saving_does_not_change_outputs(baseline, populated, s3):
    assert same(populated["outputs"]["P"], baseline["P"])
    assert same(populated["outputs"]["S"], baseline["S0"])
    # Every full chunk of P, including the decoded ones, is in the bucket.
    prompt_and_output = P + baseline["P"]["tokens"][:-1]
    for i in range(len(prompt_and_output) // CHUNK):
        s3.head_object(Bucket=BUCKET, Key=populated["key"](prompt_and_output, i))


def assert_fresh_engine_hits_and_matches(engine: Engine, baseline: dict) -> None:
    """A fresh engine serves A and the BATCH from the stored chunks of the populated bucket."""
    # All full chunks of P are hit; the output equals the engine without
    # the connector serving A after P from its own prefix cache.
    out = engine.generate([A], MAX_TOKENS)[0]
    assert out["num_cached_tokens"] == len(P) // CHUNK * CHUNK
    assert same(out, baseline["A_after_P"])

    # Several requests sharing a prefix, in one batch, each load it.
    outs = engine.generate(BATCH, MAX_TOKENS)
    for out, expected in zip(outs, baseline["BATCH_after_S0"]):
        assert out["num_cached_tokens"] == expected["num_cached_tokens"] > 0
        assert same(first_token(out), first_token(expected), BATCH_LOGPROB_TOLERANCE)


def test_bulk_load_from_the_tls_store_hits_stored_prefix_and_matches(tiny_model, versitygw, baseline, populated,
                                                                     s3):
    """``load_mode: bulk`` (every layer lands before the load is reported) gives the same outputs, here with the
    chunks on the second S3 server, reached over TLS through ``ca_bundle`` (loads and the saves of A and the
    BATCH both go there)."""
    tls = versitygw.client()
    tls.create_bucket(Bucket=f"{BUCKET}-bulk")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for stored in page.get("Contents", []):
            body = s3.get_object(Bucket=BUCKET, Key=stored["Key"])["Body"].read()
            tls.put_object(Bucket=f"{BUCKET}-bulk", Key=stored["Key"], Body=body)
    with Engine(tiny_model, kv_config(versitygw, f"{BUCKET}-bulk", load_mode="bulk"), s3=versitygw) as engine:
        assert_fresh_engine_hits_and_matches(engine, baseline)
        # What the engine saves goes to the TLS store too: A's own last chunk (saved behind the answer).
        poll(lambda: object_size(tls, f"{BUCKET}-bulk", populated["key"](A, len(A) // CHUNK - 1)),
             lambda size: size is not None, 60, "A's last chunk on the TLS store")  # fmt: skip


def _copy_of_populated(s3, bucket: str) -> str:
    """The populated bucket copied: serving A and the BATCH stores their chunks past the populated ones, which
    would lengthen the other tests' hits."""
    s3.create_bucket(Bucket=bucket)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for stored in page.get("Contents", []):
            s3.copy_object(Bucket=bucket, Key=stored["Key"], CopySource={"Bucket": BUCKET, "Key": stored["Key"]})
    return bucket


def test_tiered_store_fills_its_local_tier_and_serves_hits_from_it(tiny_model, seaweedfs, baseline, populated, s3,
                                                                   tmp_path):
    """``tiered: [dualblade, s3]``: the first engine's hits come from S3 and fill the local tier; with the bucket
    emptied, a restarted engine's hits come from the local tier alone, and both outputs match."""
    bucket = _copy_of_populated(s3, f"{BUCKET}-tiered")
    object_bytes = s3.head_object(Bucket=bucket, Key=populated["key"](A, 0))["ContentLength"]
    # Room for 64 chunks; page-cache knob for 2 layers of each: both paths carry every hit.
    local = {"backend": "dualblade", "root": str(tmp_path / "local"), "capacity_bytes": 64 * align_up(object_bytes),
             "page_cache_bytes": 64 * 2 * object_bytes // TINY_LLAMA["num_hidden_layers"]}
    config = kv_config(seaweedfs, bucket)
    config["kv_connector_extra_config"]["store"] = {"backend": "tiered", "tiers": [local, config["kv_connector_extra_config"]["store"]]}
    hit_chunks = len(P) // CHUNK
    journal = str(tmp_path / "local" / JOURNAL)

    def locally_bound() -> dict:
        return BindMap(journal, 64, writer=False).bindings

    with Engine(tiny_model, config, s3=seaweedfs) as engine:
        out = engine.generate([A], MAX_TOKENS)[0]
        assert out["num_cached_tokens"] == hit_chunks * CHUNK
        assert same(out, baseline["A_after_P"])
        # Fills run behind the load; wait for them through the tier's journal.
        poll(locally_bound, lambda bound: all(populated["key"](A, i) in bound for i in range(hit_chunks)), 120,
             "the local tier holding P's chunks")

    # Only P's chunks stay local (A's own were written through too) and nothing is left in S3.
    extra = [key for key in locally_bound() if key not in {populated["key"](A, i) for i in range(hit_chunks)}]
    writer = BindMap(journal, 64, writer=True)
    writer.unbind(extra)
    writer.close()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for stored in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=stored["Key"])
    with Engine(tiny_model, config, s3=seaweedfs) as engine:
        out = engine.generate([A], MAX_TOKENS)[0]
        assert out["num_cached_tokens"] == hit_chunks * CHUNK
        assert same(out, baseline["A_after_P"])


def test_fresh_engine_hits_stored_prefix_and_matches(tiny_model, seaweedfs, baseline, populated, s3):
    """The default ``load_mode: layerwise``; then the ways a stored chunk can be wrong."""
    key, chunk_hashes_of = populated["key"], populated["hashes"]
    with Engine(tiny_model, kv_config(seaweedfs), s3=seaweedfs) as engine:
        assert_fresh_engine_hits_and_matches(engine, baseline)

        # A chunk truncated after the scheduler has seen it present: the read
        # fails, its blocks are reported, vLLM recomputes, output unchanged.
        s3.put_object(Bucket=BUCKET, Key=key(A, BOUNDARY_CHUNK), Body=b"\0" * 100)
        out = engine.generate([A], MAX_TOKENS)[0]
        assert same(out, baseline["A"])
        assert f"chunk {key(A, BOUNDARY_CHUNK)} unreadable; hit shortened" in engine.log_text()

        # A chunk of the right size with wrong bytes (bit rot, a torn write):
        # its digests do not match, so it is a miss like the truncated one;
        # the reader deletes it and the recomputed chunk is stored again.
        # (The size comes from an untouched chunk: the truncated one may still be on its way back.)
        noise = _noise(s3.head_object(Bucket=BUCKET, Key=key(A, 0))["ContentLength"])
        s3.put_object(Bucket=BUCKET, Key=key(A, BOUNDARY_CHUNK), Body=noise)
        out = engine.generate([A], MAX_TOKENS)[0]
        assert same(out, baseline["A"])
        assert f"store chunk {key(A, BOUNDARY_CHUNK)} failed its integrity check (blake3-keyed)" in engine.log_text()
        assert _stored_or_none(s3, key(A, BOUNDARY_CHUNK)) != noise

        # Negative control: another chunk's KV resealed with a valid trailer
        # for this one (by a writer holding the deployment's key: integrity
        # defaults to keyed) is served as a hit, and the comparison must catch it.
        original = s3.get_object(Bucket=BUCKET, Key=key(SHARED, 5))["Body"].read()
        other = s3.get_object(Bucket=BUCKET, Key=key(SHARED, 4))["Body"].read()
        bad = resealed(other, chunk_hashes_of(SHARED)[5], TINY_LLAMA["num_hidden_layers"])
        s3.put_object(Bucket=BUCKET, Key=key(SHARED, 5), Body=bad)
        try:
            out = engine.generate([BATCH[1]], MAX_TOKENS)[0]
        finally:
            s3.put_object(Bucket=BUCKET, Key=key(SHARED, 5), Body=original)
        assert out["num_cached_tokens"] > 6 * CHUNK  # the forged chunk was served
        assert not same(out, baseline["S1_after_S0"], BATCH_LOGPROB_TOLERANCE)


def test_a_salt_or_an_adapter_hits_only_its_own_chunks(tiny_model, seaweedfs, plain_engine, s3, tmp_path):
    """The same prompt under salts A, A, B and none, then none again, then LoRA adapters a, a, b: only the
    second of each hits, each output equal to the engine without the connector (cold, or after its own prefix
    cache), under the same salt or adapter."""
    prompt = SALTED
    adapters = {name: (name, str(write_lora_adapter(tiny_model, tmp_path / name, seed))) for seed, name in enumerate("ab")}
    turns = [{"cache_salts": [salt]} for salt in ("A", "A", "B", None, None)]
    turns += [{"loras": [adapters[name]]} for name in ("a", "a", "b")]
    baselines: dict[str, tuple[dict, dict]] = {}  # per salt or adapter: cold, and after its own prefix cache
    for turn in turns:
        if repr(turn) not in baselines:
            cold = plain_engine.generate([prompt], MAX_TOKENS, **turn)[0]
            baselines[repr(turn)] = cold, plain_engine.generate([prompt], MAX_TOKENS, reset_prefix_cache=False, **turn)[0]
    expected = [baselines[repr(turn)] for turn in turns]
    hit = (len(prompt) - 1) // CHUNK * CHUNK
    assert expected[5][1]["num_cached_tokens"] == hit
    # Control: an adapter changes the output (its v_proj, the KV), so plain chunks served to it would show.
    assert not same(expected[5][0], expected[3][0]) and not same(expected[5][0], expected[7][0])
    bucket = f"{BUCKET}-salts"
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(Engine(tiny_model, kv_config(seaweedfs, bucket), s3=seaweedfs, max_loras=2))
        namespace, prefix = engine.ready["namespace"], engine.ready["key_prefix"]
        # Size-checked HEADs on the bucket the engine made.
        store = stack.enter_context(contextlib.closing(seaweedfs.lookup_store(seaweedfs.store_config(bucket), LAYOUT)))

        def keys(chain: str) -> list[str]:
            return [chunk_key(prefix, namespace, h) for h in chunk_hashes(chain, prompt, CHUNK)]

        def chain(turn: dict) -> str:
            salt, lora = (turn.get("cache_salts") or [None])[0], (turn.get("loras") or [None])[0]
            return isolated_chain(namespace, cache_salt=salt, lora=lora)

        outs = []
        for turn in turns:
            outs.append(engine.generate([prompt], MAX_TOKENS, **turn)[0])
            # Saves end after the answer: the next turn of this chain hits what is stored by then, so wait.
            wait_stored(store, keys(chain(turn)), 120)
        # Each chain holds the prompt's chunks once: the salts', the adapters' and the plain ones apart.
        chains = [isolated_chain(namespace, cache_salt=salt) for salt in ("A", "B", None)]
        chains += [isolated_chain(namespace, lora=adapters[name]) for name in "ab"]
        assert len(set(chains)) == 5
        assert [store.lookup(keys(chain)) for chain in chains] == [len(prompt) // CHUNK] * 5
    assert [out["num_cached_tokens"] for out in outs] == [0, hit, 0, 0, hit, 0, hit, 0]
    firsts = [i for i, turn in enumerate(turns) if turn not in turns[:i]]
    for i, (out, (cold, after_itself)) in enumerate(zip(outs, expected)):
        assert same(out, cold if i in firsts else after_itself), f"turn {i} ({turns[i]}) differs"


def _stored_or_none(s3, key: str, bucket: str = BUCKET) -> bytes | None:
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None


def _noise(size: int) -> bytes:
    return np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_missing_or_truncated_chunk_shortens_hit(tiny_model, seaweedfs, baseline, populated, s3):
    key = populated["key"]
    s3.delete_object(Bucket=BUCKET, Key=key(P, BOUNDARY_CHUNK))
    s3.put_object(Bucket=BUCKET, Key=key(SHARED, BOUNDARY_CHUNK), Body=b"\0" * 100)
    with Engine(tiny_model, kv_config(seaweedfs), s3=seaweedfs) as engine:
        out = engine.generate([A], MAX_TOKENS)[0]
        assert out["num_cached_tokens"] == BOUNDARY_CHUNK * CHUNK
        assert same(out, baseline["A"])
        out = engine.generate([BATCH[2]], MAX_TOKENS)[0]
        assert out["num_cached_tokens"] == BOUNDARY_CHUNK * CHUNK
        assert same(out, baseline["S2"])


def test_bad_extra_config_key_fails_startup_naming_it(tiny_model, seaweedfs):
    log = start_engine_expecting_failure(tiny_model, kv_config(seaweedfs, chunk_token=64), s3=seaweedfs)
    assert "unknown key kv_connector_extra_config.'chunk_token'" in log
