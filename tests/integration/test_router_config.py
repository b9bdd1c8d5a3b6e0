"""Router YAML: the shipped example loads; every mistake names its key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nixl_backends.configuration import ConfigError

from dualpath_connector.protocol import StoreKeySpace
from dualpath_router.config import load_router_config

REPO_ROOT = Path(__file__).resolve().parents[2]

VALID = {
    "served_model_names": ["m"],
    "vocab_size": 1024,
    "prefill_engines": [{"name": "pe0", "url": "http://127.0.0.1:8100", "node": "a"}],
    "decode_engines": [{"name": "de0", "url": "http://127.0.0.1:8200", "node": "b", "side_channel": "127.0.0.1:5700"}],
}


def test_shipped_example_loads():
    config = load_router_config(REPO_ROOT / "configs" / "router.yaml")
    assert (config.host, config.port, config.policy, config.read_side) == ("127.0.0.1", 8000, "dualpath", "auto")
    assert [e.url for e in config.engines()] == ["http://127.0.0.1:8100", "http://127.0.0.1:8200"]
    assert config.decode_engines[0].side_channel == "127.0.0.1:5700"
    assert config.store.bucket == "dualpath-kv" and config.store.addressing_style == "path"
    assert config.namespace == "auto"
    assert config.vocab_size == 1024 and config.engine_api_key_env == "DUALPATH_ENGINE_API_KEY"


def test_explicit_namespace(tmp_path):
    namespace = {"digest": "ab12", "key_prefix": "kv", "chunk_tokens": 32, "num_layers": 4, "layer_block_bytes": 8}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({**VALID, "namespace": namespace}))
    assert load_router_config(path).namespace == StoreKeySpace(**namespace)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prefill_engines": [{"name": "pe0", "url": "ftp://x", "node": "a"}]}, "prefill_engines[0].url"),
        ({"prefill_engines": [{"name": "pe0", "url": "http://x:1"}]}, "prefill_engines[0].'node'"),
        ({"decode_engines": [{"name": "de0", "url": "http://x:1", "node": "b"}]}, "decode_engines[0].'side_channel'"),
        ({"decode_engines": [{"name": "de0", "url": "http://x:1", "node": "b", "side_channel": "x"}]},
         "decode_engines[0].side_channel"),
        ({"policy": "fastest"}, "'policy'"),
        ({"read_side": "both"}, "'read_side'"),
        ({"scheduling": {"alpha": 3}}, "scheduling.'alpha'"),
        ({"scheduling": {"beta_s": 0}}, "scheduling.beta_s"),
        ({"timeouts": {"connect_s": -1}}, "timeouts.connect_s"),
        ({"store": {"backend": "s3", "bucket": "b-kv", "secret_key": "s3cr3t"}}, "store.access_key/secret_key"),
        ({"store": {"backend": "tape"}}, "store.'backend'"),
        ({"namespace": {"digest": "xyz", "key_prefix": "p", "chunk_tokens": 32, "num_layers": 4,
                        "layer_block_bytes": 8}}, "namespace.digest"),
        ({"namespace": {"digest": "ab12", "key_prefix": "p", "chunk_tokens": 0, "num_layers": 4,
                        "layer_block_bytes": 8}}, "namespace.chunk_tokens must be positive"),
        ({"namespace": {"digest": "ab12", "key_prefix": "p", "chunk_tokens": 32}}, "namespace.'num_layers'"),
        ({"namespace": {"digest": "ab12", "key_prefix": "p", "chunk_tokens": "32", "num_layers": 4,
                        "layer_block_bytes": 8}}, "namespace.'chunk_tokens'"),
        ({"served_model_names": []}, "served_model_names"),
        ({"port": "eighty"}, "'port'"),
        ({"vocab_size": 0}, "vocab_size must be positive"),
        ({"vocab_size": "1024"}, "'vocab_size'"),
        ({"max_prompt_tokens": -1}, "max_prompt_tokens must be positive"),
        ({"heap_trim_interval_s": -1}, "heap_trim_interval_s must be a finite number >= 0"),
        ({"heap_trim_interval_s": float("nan")}, "heap_trim_interval_s must be a finite number >= 0"),
        ({"vocab_size": None}, "set `tokenizer` (a Hugging Face tokenizer directory), `model_config`"),
        # A key pasted where its variable's name belongs: refused, and not echoed.
        ({"engine_api_key_env": "s3cr3t key"}, "engine_api_key_env must name an environment variable"),
        ({"extra": 1}, "unknown key 'extra'"),
    ],
)
def test_errors_name_the_key(tmp_path, change, message):
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({**VALID, **change}))
    with pytest.raises(ConfigError) as info:
        load_router_config(path)
    assert str(info.value).startswith("router.yaml: ")
    assert message in str(info.value)
    assert "s3cr3t" not in str(info.value)


def test_cli_refuses_a_bad_config_naming_the_key(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({**VALID, "scheduling": {"beta": 5}}))
    result = subprocess.run([sys.executable, "-m", "dualpath_router.app", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "router.yaml: unknown key scheduling.'beta'" in result.stderr
