"""kv_connector_extra_config parsing: every mistake names its key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from types import SimpleNamespace

import torch

from dualpath_connector.config import (
    DualPathConfig,
    check_parallel,
    check_resolved_layout,
    expected_kv_cache_layout,
    namespace_for,
    parse_config,
    resolve_chunk_tokens,
)
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
def test_shipped_configs_parse(name, monkeypatch):
    shipped = json.loads((Path(__file__).resolve().parents[2] / "configs" / name).read_text())
    monkeypatch.delenv("DUALPATH_INTEGRITY_KEY", raising=False)
    with pytest.raises(ConfigError, match="DUALPATH_INTEGRITY_KEY"):  # keyed: the deployment's secret is required
        parse_config(shipped["kv_connector_extra_config"], shipped["kv_role"])
    monkeypatch.setenv("DUALPATH_INTEGRITY_KEY", "shipped-config-integrity-secret")
    config = parse_config(shipped["kv_connector_extra_config"], shipped["kv_role"])
    assert config.integrity == "keyed" and config.integrity_key is not None
    assert isinstance(config.store_config, S3StoreConfig)
    assert config.load_mode == "layerwise"
    assert shipped["kv_connector_module_path"] == "dualpath_connector"


def test_shipped_tiered_config_parses():
    from nixl_backends.dualblade import DualBladeStoreConfig
    from nixl_backends.tiered import TieredStoreConfig

    shipped = json.loads((Path(__file__).resolve().parents[2] / "configs" / "single-tiered.json").read_text())
    config = parse_config(shipped["kv_connector_extra_config"], shipped["kv_role"])
    assert isinstance(config.store_config, TieredStoreConfig)
    local, shared = config.store_config.tier_configs
    assert isinstance(local, DualBladeStoreConfig) and isinstance(shared, S3StoreConfig)


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
        ({"store": POSIX, "split_read_min_tokens": -1}, "split_read_min_tokens must not be negative"),
        ({"store": POSIX, "moved_read_min_deadline_s": 1000.0},
         "moved_read_min_deadline_s must be between 0 and de_read_timeout_s"),
        # Layers interleaved inside a head: a block is not one run per layer.
        ({"store": POSIX, "kv_cache_layout": "BHLNC"}, "'kv_cache_layout'"),
        ({"store": POSIX, "kv_cache_layout": "NHD"}, "'kv_cache_layout'"),
        ({"store": {"backend": "posix"}}, "store.'root'"),
        ({"store": {"backend": "posix", "root": "/x", "rot": 1}}, "store.'rot'"),
        ({"store": {"backend": "tape"}}, "store.'backend'"),
        ({"store": "s3://bucket"}, "store"),
        (
            {"store": {"backend": "s3", "bucket": "abc", "access_key": "AK", "secret_key": "SK"}},
            "store.secret_key would be written to vLLM's start-up log",
        ),
        (
            {"store": {"backend": "s3agg", "gateway": "http://127.0.0.1:1",
                       "s3": {"bucket": "abc", "access_key": "AK", "secret_key": "SK"}}},
            "store.s3.secret_key would be written to vLLM's start-up log",
        ),
        (
            {"store": {"backend": "s3agg", "gateway": "ftp://127.0.0.1:1", "s3": {"bucket": "abc"}}},
            "store.gateway must be http://host:port or https://host:port",
        ),
        (
            {"store": {"backend": "s3agg", "gateway": "http://127.0.0.1:1", "gateway_ca_bundle": "/etc/hostname",
                       "s3": {"bucket": "abc"}}},
            "store.gateway_ca_bundle is for an https:// gateway",
        ),
        (
            {"store": {"backend": "s3agg", "gateway": "https://127.0.0.1:1", "gateway_ca_bundle": "/no/such/ca.pem",
                       "s3": {"bucket": "abc"}}},
            "store.gateway_ca_bundle: no such file",
        ),
        (
            {"store": {"backend": "tiered", "tiers": [{"backend": "posix", "root": "/x"},
                                                      {"backend": "s3", "bucket": "abc", "secret_key": "SK"}]}},
            "store.tiers[1].secret_key would be written to vLLM's start-up log",
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


def test_the_expected_layout_is_the_connectors_unless_vllm_is_told_another(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    assert expected_kv_cache_layout(parse_config({"store": POSIX})) == "LBHNC"
    assert expected_kv_cache_layout(parse_config({"store": POSIX, "kv_cache_layout": "BLNHC"})) == "BLNHC"
    # vLLM honours its environment variable over any connector's wish, and so do we (with its legacy names).
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "NHD")
    assert expected_kv_cache_layout(parse_config({"store": POSIX})) == "LBNHC"
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BHLNC")
    with pytest.raises(ConfigError, match="VLLM_KV_CACHE_LAYOUT=BHLNC is not a layout DualPathConnector copies"):
        expected_kv_cache_layout(parse_config({"store": POSIX}))


def test_a_layout_vllm_resolved_otherwise_fails_start_up_naming_the_key(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    config = parse_config({"store": POSIX})

    def resolved(name):
        return SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=name))

    check_resolved_layout(resolved("LBHNC"), config)
    check_resolved_layout(resolved(None), config)  # the API server: not resolved there, nothing to check
    with pytest.raises(ConfigError, match="resolved KV cache layout LBNHC.*kv_connector_extra_config.kv_cache_layout"):
        check_resolved_layout(resolved("LBNHC"), config)


def _vllm_config(*, use_mla: bool, heads: int, head_size: int):
    model = SimpleNamespace(
        model="m", dtype=torch.bfloat16, use_mla=use_mla, get_num_kv_heads=lambda parallel: heads,
        get_head_size=lambda: head_size, get_num_layers=lambda parallel: 4,
    )  # fmt: skip
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16, kv_cache_layout=None),
        attention_config=SimpleNamespace(backend=None),
    )


def test_namespace_sizes_mla_as_one_latent_vector_and_records_the_layout(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    config = parse_config({"store": POSIX})
    mla = namespace_for(_vllm_config(use_mla=True, heads=1, head_size=576), config, 32, 0, 0)
    assert mla.layer_block_bytes == 576 * 32 * 2 and mla.kv_layout == "LBHNC/mla"
    mha = namespace_for(_vllm_config(use_mla=False, heads=2, head_size=64), config, 32, 0, 0)
    assert mha.layer_block_bytes == 2 * 2 * 64 * 32 * 2 and mha.kv_layout == "LBHNC/kv"
    # Another byte order of the same blocks is another namespace: they never share chunks.
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    other = namespace_for(_vllm_config(use_mla=False, heads=2, head_size=64), config, 32, 0, 0)
    assert other.kv_layout == "LBNHC/kv" and other.digest() != mha.digest()
    # Where vLLM resolved the layout (scheduler, worker), the namespace is refused unless it is that one.
    resolved = _vllm_config(use_mla=False, heads=2, head_size=64)
    resolved.cache_config.kv_cache_layout = "LBHNC"
    with pytest.raises(ConfigError, match="resolved KV cache layout LBHNC, DualPathConnector expects LBNHC"):
        namespace_for(resolved, config, 32, 0, 0)


def test_tp_ranks_get_their_own_namespace_except_for_an_mla_latent_which_every_rank_shares(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    config = parse_config({"store": POSIX})

    def at_tp2(use_mla: bool):
        vllm = _vllm_config(use_mla=use_mla, heads=1 if use_mla else 2, head_size=576 if use_mla else 64)
        vllm.parallel_config.tensor_parallel_size = 2
        return vllm

    mha = [namespace_for(at_tp2(False), config, 32, rank, 0) for rank in range(2)]
    assert mha[0].digest() != mha[1].digest() and mha[1].tp_rank == 1
    mla = [namespace_for(at_tp2(True), config, 32, rank, 0) for rank in range(2)]
    assert mla[0].digest() == mla[1].digest() and mla[1].tp_rank == 0
    assert mla[0].tp_size == 2  # a latent written at TP=2 is still not served to a TP=1 engine


def test_pipeline_parallel_and_a_side_channel_port_range_past_65535_are_refused_at_start_up():
    def parallel(tp: int, pp: int = 1):
        return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)

    pd = parse_config({"store": POSIX, "side_channel_port": 65534}, "kv_producer")
    check_parallel(parallel(2), pd, "kv_producer")  # ranks at 65534 and 65535
    with pytest.raises(ConfigError, match="side_channel_port 65534: TP rank 2 would serve at port 65536"):
        check_parallel(parallel(3), pd, "kv_producer")
    for role, config in (("kv_both", parse_config({"store": POSIX})), ("kv_producer", pd)):
        with pytest.raises(ConfigError, match="does not support pipeline parallel size 2"):
            check_parallel(parallel(1, pp=2), config, role)
    check_parallel(parallel(8), parse_config({"store": POSIX}), "kv_both")
