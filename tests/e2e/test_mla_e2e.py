"""MLA end to end on vLLM's CPU build: the tiny DeepSeek-V2-style model, KV in a POSIX store.

An MLA cache holds one latent vector per token per layer (kv_lora_rank +
qk_rope_head_dim values, no separate K and V); vLLM's CPU build serves it with
its CPU_MLA backend. As with the tiny Llama, a large init scale makes a wrong
KV cache change the greedy tokens or their logprobs; the negative control
proves the comparison can fail.
"""

from __future__ import annotations

import random

import pytest

from dualpath_dev.tiny_model import TINY_DEEPSEEK_V2
from nixl_backends.layout import DIGEST_BYTES, chunk_hashes, chunk_key
from tests.conftest import resealed, same
from tests.vllm_engine import Engine, start_side_by_side

pytestmark = pytest.mark.engine

# vLLM's CPU MLA decode kernel runs with block_size 16 only, and vLLM forces it
# whatever the runner asks; chunk_tokens defaults to the block size.
CHUNK = 16
MAX_TOKENS = 40
LAYERS = TINY_DEEPSEEK_V2["num_hidden_layers"]
LATENT = TINY_DEEPSEEK_V2["kv_lora_rank"] + TINY_DEEPSEEK_V2["qk_rope_head_dim"]

_rng = random.Random(4321)
P = [_rng.randrange(1024) for _ in range(1500)]
# P's full chunks and a few tokens more: see the baseline for why only 4.
A = P + [_rng.randrange(1024) for _ in range(4)]
HIT = len(P) // CHUNK * CHUNK


# Why the baseline is vLLM's ExampleConnector: on CPU, vLLM turns prefix caching
# (and chunked prefill) off for MLA models, so no engine without a connector
# ever computes A from a hit; and a cold prefill of A is not a reference (the
# prefix's attention is computed and merged differently, and the tiny model
# amplifies the last bits: tokens differ within a few steps). vLLM's own
# reference connector saves P's KV and injects it for A, so A runs the very
# computation a store hit runs. It saves a prompt's first (len - 1) // 16 * 16
# tokens, looks a prompt up by its first (len - 2) // 16 * 16 and loads its
# first (len - 1) // 16 * 16: A hits P's 1488 tokens for 1490 <= len(A) <= 1504.
# On hosts with AMX tiles vLLM picks its AMX_MLA backend instead, which keeps chunked
# prefill and prefix caching on (the ExampleConnector then saves only P's first 512-token
# step): every engine here runs the reference CPU_MLA backend, so the test means the same
# on every host.
MLA_BACKEND = {"attention_backend": "CPU_MLA"}


def example_connector(root) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(root)},
    }


def dualpath(root) -> dict:
    return {
        "kv_connector": "DualPathConnector",
        "kv_connector_module_path": "dualpath_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": {"backend": "posix", "root": str(root)}},
    }


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    return tmp_path_factory.mktemp("mla-store")


@pytest.fixture(scope="module")
def first_runs(tiny_mla_model, store_root, tmp_path_factory) -> dict:
    """The baseline engine (ExampleConnector) serves P then A; a first engine with the connector serves P,
    which stores its chunks. The two are independent: they start side by side, and stop before the tests."""
    root = tmp_path_factory.mktemp("example-connector")
    engines = start_side_by_side(lambda: Engine(tiny_mla_model, example_connector(root), **MLA_BACKEND),
                                 lambda: Engine(tiny_mla_model, dualpath(store_root), **MLA_BACKEND))  # fmt: skip
    reference, first = engines
    try:
        baseline = {"P": reference.generate([P], MAX_TOKENS)[0]}
        baseline["A_after_P"] = reference.generate([A], MAX_TOKENS)[0]
        saved = first.generate([P], MAX_TOKENS)[0]
        return {"baseline": baseline, "saved": saved, "ready": first.ready}
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="module")
def baseline(first_runs):
    out = first_runs["baseline"]
    assert out["P"]["num_cached_tokens"] == 0
    assert out["A_after_P"]["num_cached_tokens"] == HIT
    return out


@pytest.fixture(scope="module")
def populated(store_root, first_runs):
    """What the first engine with the connector answered for P; where its chunks are."""
    out = first_runs["saved"]
    namespace, prefix = first_runs["ready"]["namespace"], first_runs["ready"]["key_prefix"]

    def chunk_hash(tokens: list[int], i: int) -> str:
        return chunk_hashes(namespace, tokens, CHUNK)[i]

    return {"P": out, "path": lambda tokens, i: store_root / chunk_key(prefix, namespace, chunk_hash(tokens, i)),
            "hash": chunk_hash}  # fmt: skip


def test_saving_does_not_change_outputs_and_stores_one_latent_per_token(baseline, populated):
    assert same(populated["P"], baseline["P"])
    # Every full chunk of P, including the decoded ones, is stored, each one
    # latent vector (bf16) per token per layer: no K/V factor 2.
    prompt_and_output = P + baseline["P"]["tokens"][:-1]
    for i in range(len(prompt_and_output) // CHUNK):
        assert populated["path"](prompt_and_output, i).stat().st_size == LAYERS * (CHUNK * LATENT * 2 + DIGEST_BYTES)


def test_fresh_engine_hits_stored_prefix_and_matches(tiny_mla_model, store_root, baseline, populated):
    path = populated["path"]
    with Engine(tiny_mla_model, dualpath(store_root), **MLA_BACKEND) as engine:
        out = engine.generate([A], MAX_TOKENS)[0]
        assert out["num_cached_tokens"] == HIT
        assert same(out, baseline["A_after_P"])

        # Negative control: another chunk's latents resealed with a valid
        # checksum trailer for this one are served as a hit (the engine has no
        # prefix cache of its own, so A loads again), and the comparison must catch it.
        original = path(P, 5).read_bytes()
        path(P, 5).write_bytes(resealed(path(P, 4).read_bytes(), populated["hash"](P, 5), LAYERS))
        try:
            out = engine.generate([A], MAX_TOKENS)[0]
        finally:
            path(P, 5).write_bytes(original)
        assert out["num_cached_tokens"] == HIT  # the forged chunk was served
        assert not same(out, baseline["A_after_P"])
