"""The shared data model: namespace digest, chunk hash chain, block arithmetic, keys."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from nixl_backends.layout import HASH_HEX_CHARS, BlockLayout, KVNamespace, chunk_hashes, chunk_key

CHUNK = 16


def _namespace(**overrides) -> KVNamespace:
    fields = dict(
        model="tiny-llama",
        dtype="bfloat16",
        block_size=16,
        chunk_tokens=CHUNK,
        num_layers=4,
        num_kv_heads=2,
        head_size=64,
        kv_layout="NHD",
        layer_block_bytes=16384,
        tp_size=1,
        tp_rank=0,
    )
    fields.update(overrides)
    return KVNamespace(**fields)


NS = _namespace().digest()
TOKENS = [(i * 7919 + 13) % 32000 for i in range(CHUNK * 6 + 5)]  # 6 full chunks + a partial one


# --- hash chain ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_chunk_hashes_same_in_another_process(seed):
    code = (
        "import json, sys\n"
        "from nixl_backends.layout import chunk_hashes\n"
        "ns, tokens, chunk = json.loads(sys.stdin.read())\n"
        "print(json.dumps(chunk_hashes(ns, tokens, chunk)))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED=seed)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([NS, TOKENS, CHUNK]),
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = chunk_hashes(NS, TOKENS, CHUNK)
    assert len(ours) == 6
    assert theirs == ours


def test_chunk_hashes_shape_and_uniqueness():
    hashes = chunk_hashes(NS, TOKENS, CHUNK)
    assert len(hashes) == len(TOKENS) // CHUNK
    assert all(len(h) == HASH_HEX_CHARS and int(h, 16) >= 0 for h in hashes)
    assert len(set(hashes)) == len(hashes)


def test_chunk_hashes_accepts_numpy_and_list_alike():
    import numpy as np

    assert chunk_hashes(NS, np.asarray(TOKENS, dtype=np.int32), CHUNK) == chunk_hashes(NS, TOKENS, CHUNK)


@pytest.mark.parametrize("start", [1, 2, 5])
def test_incremental_extension_equals_hashing_from_zero(start):
    full = chunk_hashes(NS, TOKENS, CHUNK)
    head = chunk_hashes(NS, TOKENS[: start * CHUNK], CHUNK)
    assert head == full[:start]
    tail = chunk_hashes(NS, TOKENS, CHUNK, start_chunk=start, previous_hash=head[-1])
    assert tail == full[start:]
    assert head + tail == full


def test_incremental_extension_past_end_is_empty():
    full = chunk_hashes(NS, TOKENS, CHUNK)
    assert chunk_hashes(NS, TOKENS, CHUNK, start_chunk=len(full), previous_hash=full[-1]) == []


def test_start_chunk_without_previous_hash_raises():
    with pytest.raises(ValueError):
        chunk_hashes(NS, TOKENS, CHUNK, start_chunk=1)


@pytest.mark.parametrize("bad", [0, -1])
def test_non_positive_chunk_tokens_raises(bad):
    with pytest.raises(ValueError):
        chunk_hashes(NS, TOKENS, bad)


def test_partial_trailing_chunk_is_ignored():
    full_only = TOKENS[: 6 * CHUNK]
    assert chunk_hashes(NS, TOKENS, CHUNK) == chunk_hashes(NS, full_only, CHUNK)
    # Changing only the partial chunk changes nothing.
    changed = list(TOKENS)
    changed[-1] += 1
    assert chunk_hashes(NS, changed, CHUNK) == chunk_hashes(NS, TOKENS, CHUNK)
    # Fewer tokens than one chunk: no hashes at all.
    assert chunk_hashes(NS, TOKENS[: CHUNK - 1], CHUNK) == []


@pytest.mark.parametrize("chunk_index", [0, 2, 5])
@pytest.mark.parametrize("position", [0, CHUNK - 1])
def test_one_token_change_changes_that_chunk_and_every_later_one(chunk_index, position):
    base = chunk_hashes(NS, TOKENS, CHUNK)
    changed = list(TOKENS)
    changed[chunk_index * CHUNK + position] += 1
    after = chunk_hashes(NS, changed, CHUNK)
    assert len(after) == len(base)
    assert after[:chunk_index] == base[:chunk_index]
    for i in range(chunk_index, len(base)):
        assert after[i] != base[i], i


def test_different_namespace_digest_changes_every_hash():
    other = _namespace(dtype="float16").digest()
    assert other != NS
    a = chunk_hashes(NS, TOKENS, CHUNK)
    b = chunk_hashes(other, TOKENS, CHUNK)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_token_order_matters():
    swapped = list(TOKENS)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert TOKENS[0] != TOKENS[1]
    assert chunk_hashes(NS, swapped, CHUNK)[0] != chunk_hashes(NS, TOKENS, CHUNK)[0]


# --- namespace digest ----------------------------------------------------------------------------


def test_namespace_digest_is_stable():
    assert _namespace().digest() == _namespace().digest()
    assert _namespace().digest() == NS
    assert len(NS) == 32 and int(NS, 16) >= 0


def test_namespace_digest_same_in_another_process():
    code = (
        "from nixl_backends.layout import KVNamespace\n"
        "print(KVNamespace(model='tiny-llama', dtype='bfloat16', block_size=16, chunk_tokens=16,"
        " num_layers=4, num_kv_heads=2, head_size=64, kv_layout='NHD', layer_block_bytes=16384).digest())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONHASHSEED="99"),
        check=True,
        timeout=120,
    )
    assert proc.stdout.strip().splitlines()[-1] == NS


_CHANGES = {
    "model": "other-model",
    "dtype": "float16",
    "block_size": 32,
    "chunk_tokens": 32,
    "num_layers": 5,
    "num_kv_heads": 4,
    "head_size": 128,
    "kv_layout": "HND",
    "layer_block_bytes": 32768,
    "tp_size": 2,
    "tp_rank": 1,
    "pp_size": 2,
    "pp_rank": 1,
    "platform": "cuda/FLASH_ATTN",
    "integrity": "blake3-keyed/0123456789abcdef",
}


def test_every_namespace_field_is_covered_by_the_change_table():
    assert set(_CHANGES) == {f.name for f in dataclasses.fields(KVNamespace)}


@pytest.mark.parametrize("field,value", sorted(_CHANGES.items()))
def test_any_namespace_field_change_changes_digest(field, value):
    base = _namespace()
    assert getattr(base, field) != value
    assert _namespace(**{field: value}).digest() != base.digest()


# --- block layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("layers,size", [(1, 1), (4, 16384), (32, 131072), (3, 7)])
def test_block_layout_arithmetic(layers, size):
    layout = BlockLayout(num_layers=layers, layer_block_bytes=size)
    assert layout.full_block_bytes == layers * size
    for layer in range(layers):
        assert layout.layer_range(layer) == (layer * size, (layer + 1) * size)
    # Layers tile the Full Block exactly.
    assert layout.layer_range(0)[0] == 0
    assert layout.layer_range(layers - 1)[1] == layout.full_block_bytes


@pytest.mark.parametrize("layer", [-1, 4, 5, 100])
def test_block_layout_out_of_range_layer_raises(layer):
    layout = BlockLayout(num_layers=4, layer_block_bytes=16384)
    with pytest.raises(IndexError):
        layout.layer_range(layer)


@pytest.mark.parametrize("layers,size", [(0, 16), (-1, 16), (4, 0), (4, -16), (0, 0)])
def test_block_layout_rejects_non_positive_sizes(layers, size):
    with pytest.raises(ValueError):
        BlockLayout(num_layers=layers, layer_block_bytes=size)


# --- keys ----------------------------------------------------------------------------------------


def test_chunk_key_shape():
    h = chunk_hashes(NS, TOKENS, CHUNK)[0]
    assert chunk_key("kv", NS, h) == f"kv/{NS}/{h[:2]}/{h}"


def test_chunk_key_strips_slashes_from_prefix():
    h = chunk_hashes(NS, TOKENS, CHUNK)[0]
    assert chunk_key("/a/b/", NS, h) == f"a/b/{NS}/{h[:2]}/{h}"


@pytest.mark.parametrize("prefix", ["", "/", "//"])
def test_chunk_key_empty_prefix_has_no_leading_slash(prefix):
    h = chunk_hashes(NS, TOKENS, CHUNK)[0]
    key = chunk_key(prefix, NS, h)
    assert not key.startswith("/")
    assert key == f"{NS}/{h[:2]}/{h}"


@pytest.mark.parametrize("bad", ["", "abc", "0" * 63, "0" * 65])
def test_chunk_key_rejects_bad_hash(bad):
    with pytest.raises(ValueError):
        chunk_key("kv", NS, bad)


def test_chunk_key_differs_per_chunk_and_namespace():
    hashes = chunk_hashes(NS, TOKENS, CHUNK)
    keys = {chunk_key("kv", NS, h) for h in hashes}
    assert len(keys) == len(hashes)
    other = _namespace(tp_rank=1).digest()
    assert chunk_key("kv", NS, hashes[0]) != chunk_key("kv", other, hashes[0])


# --- inputs that once slipped through ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["g" * 64, "../" * 21 + "x"], ids=["non-hex", "path-traversal"])
def test_chunk_key_rejects_non_hex_hash_of_right_length(bad):
    assert len(bad) == HASH_HEX_CHARS
    with pytest.raises(ValueError):
        chunk_key("kv", NS, bad)


def test_start_chunk_with_empty_previous_hash_raises():
    with pytest.raises(ValueError):
        chunk_hashes(NS, TOKENS, CHUNK, start_chunk=1, previous_hash="")
