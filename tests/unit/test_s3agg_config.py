"""The gateway's config: the shipped file parses, mistakes name their key, secrets stay out of sight."""

from __future__ import annotations

from pathlib import Path

import pytest

from nixl_backends.configuration import ConfigError
from s3agg_gateway_ext.config import load_config, parse_config

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "gateway.yaml"
STORE = {"backend": "s3", "endpoint": "http://127.0.0.1:8333", "bucket": "kv-bucket"}
MINIMAL = {
    "store": STORE,
    "client_access_key": "client",
    "client_secret_key": "client-secret-value",
}


def test_shipped_config_parses_with_secrets_from_the_environment(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "store-secret-value",
                        "S3AGG_CLIENT_ACCESS_KEY": "ck", "S3AGG_CLIENT_SECRET_KEY": "client-secret-value"}.items():
        monkeypatch.setenv(name, value)
    config = load_config(SHIPPED)
    assert config.store_config.secret_key == "store-secret-value"
    assert config.store_config.access_key == "ak"
    assert config.policy == "calibrated_stall_opt" and config.theta_bytes == 512 << 20
    assert "secret-value" not in repr(config)
    assert "http://127.0.0.1:8333" in repr(config)  # the parsed store section shows, its secret does not


def test_shipped_posix_config_parses(monkeypatch):
    monkeypatch.setenv("S3AGG_CLIENT_ACCESS_KEY", "ck")
    monkeypatch.setenv("S3AGG_CLIENT_SECRET_KEY", "client-secret-value")
    config = load_config(SHIPPED.with_name("gateway-posix.yaml"))
    assert (config.backing, config.buckets, config.store_config.root) == ("posix", ["dualpath-kv"], "/data/dualpath-kv")
    assert "client-secret-value" not in repr(config)


def test_missing_environment_variable_is_named(monkeypatch):
    monkeypatch.delenv("S3AGG_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match="S3AGG_UNSET_VARIABLE"):
        parse_config({**MINIMAL, "client_secret_key": "${S3AGG_UNSET_VARIABLE}"})
    with pytest.raises(ConfigError, match=r"store\.secret_key: environment variable S3AGG_UNSET_VARIABLE"):
        parse_config({**MINIMAL, "store": {**STORE, "access_key": "ak", "secret_key": "${S3AGG_UNSET_VARIABLE}"}})


def test_store_section_is_the_connectors_s3_section(monkeypatch):
    monkeypatch.setenv("S3AGG_TEST_STORE_SECRET", "store-secret-value")
    config = parse_config({**MINIMAL, "store": {
        **STORE, "region": "eu-west-1", "addressing_style": "virtual", "access_key": "ak",
        "secret_key": "${S3AGG_TEST_STORE_SECRET}"}, "io_threads": 3, "io_timeout_s": 7.0})
    store = config.store_config
    assert (store.endpoint, store.region, store.addressing_style) == ("http://127.0.0.1:8333", "eu-west-1", "virtual")
    assert (store.access_key, store.secret_key) == ("ak", "store-secret-value")
    # What the gateway sets itself: never creates buckets, its own I/O settings.
    assert (store.create_bucket, store.io_threads, store.io_timeout_s) == (False, 3, 7.0)
    assert "store-secret-value" not in repr(config)


def test_buckets_default_to_the_store_sections_bucket():
    assert parse_config(MINIMAL).buckets == ["kv-bucket"]
    served = parse_config({**MINIMAL, "buckets": ["kv-bucket", "kv-other"]})
    assert served.buckets == ["kv-bucket", "kv-other"]
    assert served.bucket_config("kv-other").bucket == "kv-other"
    assert served.bucket_config("kv-other").endpoint == "http://127.0.0.1:8333"


@pytest.mark.parametrize(("change", "message"), [
    ({"theta": 5}, "unknown key 'theta'"),
    ({"policy": "fastest"}, "bad value for 'policy'"),
    ({"port": 0}, "port must be in 1..65535"),
    ({"buckets": []}, "buckets must be a non-empty list"),
    ({"buckets": ["kv-other"]}, "store.bucket 'kv-bucket' must be one of buckets"),
    ({"store": {**STORE, "endpoint": "127.0.0.1:8333"}}, r"store\.endpoint must start with http"),
    ({"store": {**STORE, "backend": "nfs"}}, "store.backend must be 's3' or 'posix' for the gateway, got 'nfs'"),
    ({"store": {"backend": "posix", "root": "/data/kv"}}, "buckets must name exactly one bucket for a posix store"),
    ({"store": {"backend": "posix", "root": "/data/kv"}, "buckets": ["a-kv", "b-kv"]},
     "buckets must name exactly one bucket for a posix store"),
    ({"store": {"backend": "posix", "root": "/data/kv", "io_engine": "dma"}, "buckets": ["kv"]},
     "bad value for store.'io_engine'"),
    ({"store": {"backend": "posix", "root": "/data/kv", "bucket": "kv"}, "buckets": ["kv"]},
     "unknown key store.'bucket'"),
    ({"store": {**STORE, "endpoint_url": "http://x"}}, "unknown key store.'endpoint_url'"),
    ({"store": {"backend": "s3"}}, "missing required key store.'bucket'"),
    ({"store": {**STORE, "access_key": "ak"}}, "store.access_key and store.secret_key must be given together"),
    ({"store": {**STORE, "create_bucket": True}}, "store.create_bucket is not accepted here"),
    ({"store": {**STORE, "io_threads": 4}}, "store.io_threads is not accepted here: .* top-level io_threads"),
    ({"store": {**STORE, "io_retries": 2}}, "store.io_retries is not accepted here: the gateway reads each range once"),
    ({"store": "http://127.0.0.1:8333"}, "bad value for 'store'"),
    ({"theta_bytes": 0}, "theta_bytes must be positive"),
    ({"bandwidth_cap_bytes_s": -1.0}, "bandwidth_cap_bytes_s must not be negative"),
    ({"staging_wait_s": 0}, "staging_wait_s must be positive"),
    ({"allow_unsigned_payload": True}, "allow_unsigned_payload needs TLS"),
    ({"tls_certfile": "/etc/hostname"}, "tls_certfile and tls_keyfile must be given together"),
    ({"tls_certfile": "/no/cert.pem", "tls_keyfile": "/no/key.pem"}, "tls_certfile: no such file"),
    ({"max_request_staging_bytes": 2 << 30, "max_staging_bytes": 1 << 30},
     r"max_request_staging_bytes \(2147483648\) must not exceed max_staging_bytes"),
])
def test_bad_values_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({**MINIMAL, **change})


def test_a_secret_of_the_wrong_type_is_not_echoed():
    with pytest.raises(ConfigError) as error:
        parse_config({**MINIMAL, "client_secret_key": 123456789})
    assert "123456789" not in str(error.value)
    with pytest.raises(ConfigError) as error:
        parse_config({**MINIMAL, "store": {**STORE, "access_key": "ak", "secret_key": 987654321}})
    assert "store.'secret_key'" in str(error.value) and "987654321" not in str(error.value)


def test_a_posix_store_is_served_as_its_one_bucket():
    config = parse_config({**MINIMAL, "store": {"backend": "posix", "root": "/data/kv"}, "buckets": ["kv-root"]})
    assert (config.backing, config.buckets, config.store_config.root) == ("posix", ["kv-root"], "/data/kv")
