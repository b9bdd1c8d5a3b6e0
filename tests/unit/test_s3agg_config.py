"""The gateway's config: the shipped file parses, mistakes name their key, secrets stay out of sight."""

from __future__ import annotations

from pathlib import Path

import pytest

from nixl_backends.configuration import ConfigError
from s3agg_gateway_ext.config import load_config, parse_config

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "gateway.yaml"
MINIMAL = {
    "store_endpoint": "http://127.0.0.1:8333",
    "buckets": ["kv-bucket"],
    "client_access_key": "client",
    "client_secret_key": "client-secret-value",
}


def test_shipped_config_parses_with_secrets_from_the_environment(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "store-secret-value",
                        "S3AGG_CLIENT_ACCESS_KEY": "ck", "S3AGG_CLIENT_SECRET_KEY": "client-secret-value"}.items():
        monkeypatch.setenv(name, value)
    config = load_config(SHIPPED)
    assert config.store_secret_key == "store-secret-value"
    assert config.policy == "calibrated_stall_opt" and config.theta_bytes == 512 << 20
    assert "secret-value" not in repr(config)


def test_missing_environment_variable_is_named(monkeypatch):
    monkeypatch.delenv("S3AGG_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match="S3AGG_UNSET_VARIABLE"):
        parse_config({**MINIMAL, "client_secret_key": "${S3AGG_UNSET_VARIABLE}"})


@pytest.mark.parametrize(("change", "message"), [
    ({"theta": 5}, "unknown key 'theta'"),
    ({"policy": "fastest"}, "bad value for 'policy'"),
    ({"port": 0}, "port must be in 1..65535"),
    ({"buckets": []}, "buckets must be a non-empty list"),
    ({"store_endpoint": "127.0.0.1:8333"}, "store_endpoint must start with http"),
    ({"theta_bytes": 0}, "theta_bytes must be positive"),
    ({"bandwidth_cap_bytes_s": -1.0}, "bandwidth_cap_bytes_s must not be negative"),
])
def test_bad_values_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**MINIMAL, **change})


def test_a_secret_of_the_wrong_type_is_not_echoed():
    with pytest.raises(ConfigError) as error:
        parse_config({**MINIMAL, "client_secret_key": 123456789})
    assert "123456789" not in str(error.value)
