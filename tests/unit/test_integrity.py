"""Chunk integrity trailers: every corruption of a stored object is caught, per layer, in both modes."""

from __future__ import annotations

import numpy as np
import pytest

from nixl_backends.configuration import ConfigError
from nixl_backends.integrity import (
    INTEGRITY_KEY_ENV,
    ChunkIntegrity,
    chunk_hash_of,
    integrity_key_from_env,
    integrity_tag,
)
from nixl_backends.layout import DIGEST_BYTES, BlockLayout, chunk_key

LAYOUT = BlockLayout(num_layers=4, layer_block_bytes=4096)
HASH_A = "ab" * 32
HASH_B = "cd" * 32
SECRET = "correct horse battery staple 42"


@pytest.fixture(params=["checksum", "keyed"])
def integrity(request, monkeypatch) -> ChunkIntegrity:
    monkeypatch.setenv(INTEGRITY_KEY_ENV, SECRET)
    return ChunkIntegrity(LAYOUT, integrity_key_from_env(request.param))


def _sealed(integrity: ChunkIntegrity, chunk_hash: str = HASH_A, seed: int = 0) -> np.ndarray:
    obj = np.zeros(LAYOUT.object_bytes, dtype=np.uint8)
    obj[: LAYOUT.full_block_bytes] = np.random.default_rng(seed).integers(0, 256, LAYOUT.full_block_bytes)
    integrity.seal(chunk_hash, obj)
    return obj


def test_object_layout_keeps_layers_in_place_and_appends_one_digest_per_layer():
    assert LAYOUT.object_bytes == LAYOUT.full_block_bytes + LAYOUT.num_layers * DIGEST_BYTES
    assert LAYOUT.layer_range(2) == (2 * 4096, 3 * 4096)
    assert LAYOUT.digest_range(0) == (LAYOUT.full_block_bytes, LAYOUT.full_block_bytes + DIGEST_BYTES)
    assert LAYOUT.digest_range(3)[1] == LAYOUT.object_bytes
    with pytest.raises(IndexError):
        LAYOUT.digest_range(4)


def test_a_sealed_object_verifies_and_each_layer_verifies_alone(integrity):
    obj = _sealed(integrity)
    assert integrity.verify(HASH_A, obj)
    for layer in range(LAYOUT.num_layers):
        start, end = LAYOUT.layer_range(layer)
        d_start, d_end = LAYOUT.digest_range(layer)
        assert integrity.verify_layer(HASH_A, layer, obj[start:end], obj[d_start:d_end])


@pytest.mark.parametrize("offset", [0, 4095, 4096 * 2 + 17, 4096 * 4 - 1])
def test_one_flipped_bit_anywhere_in_the_full_block_fails(integrity, offset):
    obj = _sealed(integrity)
    obj[offset] ^= 0x01
    assert not integrity.verify(HASH_A, obj)
    # The damaged layer is the one that fails on its own.
    layer = offset // LAYOUT.layer_block_bytes
    start, end = LAYOUT.layer_range(layer)
    assert not integrity.verify_layer(HASH_A, layer, obj[start:end], obj[slice(*LAYOUT.digest_range(layer))])


def test_a_damaged_trailer_fails(integrity):
    obj = _sealed(integrity)
    obj[LAYOUT.object_bytes - 1] ^= 0xFF
    assert not integrity.verify(HASH_A, obj)


def test_an_object_with_no_trailer_fails(integrity):
    obj = _sealed(integrity)
    obj[LAYOUT.full_block_bytes :] = 0
    assert not integrity.verify(HASH_A, obj)


def test_a_valid_object_under_another_key_or_swapped_layers_fails(integrity):
    obj = _sealed(integrity)
    # A whole valid object copied to another chunk's key.
    assert not integrity.verify(HASH_B, obj)
    # Two layers swapped together with their digests.
    swapped = obj.copy()
    s = LAYOUT.layer_block_bytes
    swapped[:s], swapped[s : 2 * s] = obj[s : 2 * s], obj[:s]
    d0, d1 = (slice(*LAYOUT.digest_range(i)) for i in (0, 1))
    swapped[d0], swapped[d1] = obj[d1], obj[d0]
    assert not integrity.verify(HASH_A, swapped)


def test_keyed_digests_need_the_key(monkeypatch):
    monkeypatch.setenv(INTEGRITY_KEY_ENV, SECRET)
    keyed = ChunkIntegrity(LAYOUT, integrity_key_from_env("keyed"))
    obj = _sealed(keyed)
    # A writer without the key: a plain checksum, or a MAC under another key, does not verify.
    for forger in (ChunkIntegrity(LAYOUT, None), ChunkIntegrity(LAYOUT, b"x" * 32)):
        forged = obj.copy()
        forger.seal(HASH_A, forged)
        assert not keyed.verify(HASH_A, forged)
        assert forger.verify(HASH_A, forged)  # negative control: the forgery is well-formed for its own key


def test_tags_name_the_algorithm_and_a_key_fingerprint_never_the_key(monkeypatch):
    assert integrity_tag(None) == "xxh3-128"
    monkeypatch.setenv(INTEGRITY_KEY_ENV, SECRET)
    key = integrity_key_from_env("keyed")
    tag = integrity_tag(key)
    assert tag.startswith("blake3-keyed/") and key.hex() not in tag and SECRET not in tag
    assert tag != integrity_tag(b"y" * 32)
    assert integrity_key_from_env("checksum") is None


@pytest.mark.parametrize("value", [None, "", "short"])
def test_keyed_mode_without_a_usable_secret_names_the_variable_not_the_value(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(INTEGRITY_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(INTEGRITY_KEY_ENV, value)
    with pytest.raises(ConfigError, match=INTEGRITY_KEY_ENV) as info:
        integrity_key_from_env("keyed", "kv_connector_extra_config.")
    assert "kv_connector_extra_config.integrity" in str(info.value)
    if value:
        assert value not in str(info.value)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="integrity"):
        integrity_key_from_env("crc")


def test_chunk_hash_of_a_key():
    assert chunk_hash_of(chunk_key("p", "ns", HASH_A)) == HASH_A
    with pytest.raises(ValueError):
        chunk_hash_of("p/ns/ab/short")


def test_keyed_is_the_default_everywhere_and_checksum_is_warned_about(monkeypatch, caplog):
    """Code defaults equal the shipped configs' mode; choosing ``checksum`` starts, with a warning naming the key."""
    from dualpath_connector.config import parse_config
    from nixl_backends.lmcache_l2 import LMCacheL2Params

    monkeypatch.delenv(INTEGRITY_KEY_ENV, raising=False)
    posix = {"backend": "posix", "root": "/tmp/unused"}
    for parse in (lambda extra: parse_config(extra), lambda extra: LMCacheL2Params(**extra).validate()):
        with pytest.raises(ConfigError, match=f"'keyed' \\(the default\\) needs .*{INTEGRITY_KEY_ENV}"):
            parse({"store": posix})
        with caplog.at_level("WARNING", logger="nixl_backends.integrity"):
            caplog.clear()
            parse({"store": posix, "integrity": "checksum"})
        assert "integrity is 'checksum'" in caplog.text and "anyone who can write to the store" in caplog.text
