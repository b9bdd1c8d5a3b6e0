"""kv_connector_extra_config parsing: every mistake names its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath_connector.config import DualPathConfig, parse_config, resolve_chunk_tokens
from nixl_backends.configuration import ConfigError
from nixl_backends.posix import PosixStoreConfig
from nixl_backends.s3 import S3StoreConfig

POSIX = {"backend": "posix", "root": "/tmp/kv"}


def test_defaults_and_store_section_are_parsed():
    config = parse_config({"store": POSIX})
    assert isinstance(config, DualPathConfig)
    assert isinstance(config.store_config, PosixStoreConfig)
    assert config.key_prefix == "dualpath"
    assert config.chunk_tokens is None


@pytest.mark.parametrize("name", ["single.json", "pe.json", "de.json"])
def test_shipped_configs_parse(name):
    shipped = json.loads((Path(__file__).resolve().parents[2] / "configs" / name).read_text())
    config = parse_config(shipped["kv_connector_extra_config"], shipped["kv_role"])
    assert isinstance(config.store_config, S3StoreConfig)
    assert config.load_mode == "layerwise"
    assert shipped["kv_connector_module_path"] == "dualpath_connector"


@pytest.mark.parametrize(
    "kv_role, extra, named",
    [
        ("kv_producer", {}, "side_channel_port is required with kv_role 'kv_producer'"),
        ("kv_consumer", {}, "side_channel_port is required with kv_role 'kv_consumer'"),
        ("kv_both", {"side_channel_port": 70000}, "side_channel_port"),
        ("kv_loader", {}, "kv_role 'kv_loader' is not supported"),
        ("kv_producer", {"side_channel_port": 5600, "pd_lease_s": 0}, "pd_lease_s"),
        ("kv_producer", {"side_channel_port": 5600, "pd_lease_s": 20, "de_read_timeout_s": 10}, "pd_lease_s (20)"),
    ],
)
def test_bad_pd_settings_name_the_key(kv_role, extra, named):
    with pytest.raises(ConfigError) as error:
        parse_config({"store": POSIX, **extra}, kv_role)
    assert named in str(error.value)


@pytest.mark.parametrize(
    "extra, named",
    [
        (None, "'store'"),
        ({}, "'store'"),
        ({"store": POSIX, "chunk_token": 64}, "'chunk_token'"),
        ({"store": POSIX, "chunk_tokens": "64"}, "'chunk_tokens'"),
        ({"store": POSIX, "chunk_tokens": 0}, "chunk_tokens"),
        ({"store": POSIX, "load_buffer_chunks": -1}, "load_buffer_chunks"),
        ({"store": POSIX, "load_mode": "sideways"}, "'load_mode'"),
        ({"store": {"backend": "posix"}}, "store.'root'"),
        ({"store": {"backend": "posix", "root": "/x", "rot": 1}}, "store.'rot'"),
        ({"store": {"backend": "tape"}}, "store.'backend'"),
        ({"store": "s3://bucket"}, "store"),
        (
            {"store": {"backend": "s3", "bucket": "abc", "access_key": "AK", "secret_key": "SK"}},
            "store.secret_key would be written to vLLM's start-up log",
        ),
    ],
)
def test_bad_config_names_the_key(extra, named):
    with pytest.raises(ConfigError) as error:
        parse_config(extra)
    assert named in str(error.value)


def test_refused_secret_is_not_echoed():
    with pytest.raises(ConfigError) as error:
        parse_config({"store": {"backend": "s3", "bucket": "abc", "access_key": "AK", "secret_key": "hunter2-secret"}})
    assert "hunter2-secret" not in str(error.value)


def test_benchmark_oracle_needs_the_benchmark_environment(monkeypatch):
    monkeypatch.delenv("DUALPATH_BENCHMARK", raising=False)
    with pytest.raises(ConfigError, match="benchmark_oracle.*DUALPATH_BENCHMARK=1"):
        parse_config({"store": POSIX, "benchmark_oracle": True})
    monkeypatch.setenv("DUALPATH_BENCHMARK", "1")
    assert parse_config({"store": POSIX, "benchmark_oracle": True}).benchmark_oracle


def test_chunk_tokens_must_be_a_multiple_of_block_size():
    assert resolve_chunk_tokens(parse_config({"store": POSIX}), 32) == 32
    assert resolve_chunk_tokens(parse_config({"store": POSIX, "chunk_tokens": 64}), 32) == 64
    with pytest.raises(ConfigError, match="chunk_tokens"):
        resolve_chunk_tokens(parse_config({"store": POSIX, "chunk_tokens": 48}), 32)


def test_import_is_cheap_and_lazy():
    import subprocess
    import sys

    code = "import sys, dualpath_connector; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
