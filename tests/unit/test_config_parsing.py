"""Store sections parsed strictly: every mistake names its key, and the S3 secret never shows."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from nixl_backends.configuration import ConfigError, from_dict
from nixl_backends.posix import PosixStoreConfig
from nixl_backends.s3 import S3StoreConfig
from nixl_backends.registry import parse_store_config

SECRET = "Sup3r-S3cret-Value-9f8e7d"


def _s3(**overrides):
    data = {"backend": "s3", "bucket": "my-bucket", "endpoint": "http://127.0.0.1:8333"}
    data.update(overrides)
    return data


def _posix(tmp_path, **overrides):
    data = {"backend": "posix", "root": str(tmp_path / "store")}
    data.update(overrides)
    return data


def _error(data, where="store.") -> str:
    with pytest.raises(ConfigError) as info:
        parse_store_config(data, where)
    return str(info.value)


# --- valid sections ------------------------------------------------------------------------------


def test_posix_section_parses_with_defaults(tmp_path):
    config = parse_store_config(_posix(tmp_path))
    assert isinstance(config, PosixStoreConfig)
    assert config.root == str(tmp_path / "store")
    assert config.io_engine == "aio"
    assert config.io_timeout_s == 30.0


def test_s3_section_parses_all_fields(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not a real certificate")
    config = parse_store_config(
        _s3(
            region="eu-west-1",
            addressing_style="virtual",
            access_key="AKIA",
            secret_key=SECRET,
            ca_bundle=str(ca),
            create_bucket=False,
            io_threads=3,
            io_timeout_s=5,  # an int is a valid float
        )
    )
    assert isinstance(config, S3StoreConfig)
    assert (config.bucket, config.endpoint, config.region) == ("my-bucket", "http://127.0.0.1:8333", "eu-west-1")
    assert config.addressing_style == "virtual"
    assert (config.access_key, config.secret_key) == ("AKIA", SECRET)
    assert config.ca_bundle == str(ca)
    assert config.create_bucket is False
    assert config.io_threads == 3
    assert config.io_timeout_s == 5


def test_input_dict_is_not_modified(tmp_path):
    data = _posix(tmp_path)
    before = dict(data)
    parse_store_config(data)
    assert data == before


# --- unknown, missing, wrong type ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["posix", "s3"])
def test_unknown_key_is_named(tmp_path, backend):
    data = _posix(tmp_path) if backend == "posix" else _s3()
    data["buckett_size"] = 3
    message = _error(data)
    assert "'buckett_size'" in message
    assert "store." in message
    assert "unknown" in message


def test_unknown_key_message_lists_valid_keys(tmp_path):
    message = _error(_posix(tmp_path, rooot="/x"))
    assert "'rooot'" in message
    for name in ("root", "io_engine", "io_timeout_s"):
        assert name in message


def test_where_prefix_is_used(tmp_path):
    message = _error(_posix(tmp_path, nope=1), where="kv_connector_extra_config.store.")
    assert "kv_connector_extra_config.store.'nope'" in message


def test_posix_missing_root_is_named():
    message = _error({"backend": "posix"})
    assert "missing" in message
    assert "'root'" in message


def test_s3_missing_bucket_is_named():
    message = _error({"backend": "s3", "endpoint": "http://127.0.0.1:8333"})
    assert "missing" in message
    assert "'bucket'" in message


@pytest.mark.parametrize(
    "backend,key,value",
    [
        ("posix", "root", 42),
        ("posix", "io_timeout_s", "30"),
        ("posix", "io_timeout_s", True),
        ("posix", "io_engine", "sync"),
        ("s3", "bucket", ["a", "b"]),
        ("s3", "io_threads", "8"),
        ("s3", "io_threads", 8.0),
        ("s3", "io_threads", True),
        ("s3", "create_bucket", "yes"),
        ("s3", "addressing_style", "auto"),
        ("s3", "endpoint", 8333),
        ("s3", "region", None),
    ],
)
def test_wrong_type_is_named(tmp_path, backend, key, value):
    data = _posix(tmp_path) if backend == "posix" else _s3()
    data[key] = value
    message = _error(data)
    assert "bad value" in message
    assert f"'{key}'" in message


@pytest.mark.parametrize("name", ["posixx", "S3", "gds", "", None, 3])
def test_bad_backend_name(name):
    message = _error({"backend": name, "root": "/tmp/x"})
    assert "'backend'" in message
    assert repr(name) in message
    assert "posix" in message and "s3" in message


def test_missing_backend_is_an_error():
    message = _error({"root": "/tmp/x"})
    assert "'backend'" in message


@pytest.mark.parametrize("data", [None, [], "posix", 3])
def test_section_must_be_a_dict(data):
    message = _error(data)
    assert "store" in message


# --- cross-field validation ----------------------------------------------------------------------


def test_s3_access_key_without_secret_key():
    message = _error(_s3(access_key="AKIA"))
    assert "access_key" in message and "secret_key" in message


def test_s3_secret_key_without_access_key_does_not_leak_secret():
    message = _error(_s3(secret_key=SECRET))
    assert "access_key" in message and "secret_key" in message
    assert SECRET not in message


@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"bucket": "ab"}, "bucket"),
        ({"bucket": "b" * 64}, "bucket"),
        ({"endpoint": "127.0.0.1:8333"}, "endpoint"),
        ({"ca_bundle": "/nonexistent/ca.pem"}, "ca_bundle"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_window_min": 0}, "io_window_min"),
        ({"io_timeout_s": 0}, "io_timeout_s"),
        ({"io_timeout_s": -1.5}, "io_timeout_s"),
        ({"io_retries": -1}, "io_retries"),
        ({"io_retries": 1.5}, "io_retries"),
        ({"io_retry_base_s": 2.0}, "io_retry_base_s"),  # above the cap
        ({"io_retry_cap_s": -1}, "io_retry_cap_s"),
        ({"io_retry_cap_s": 600.0}, "io_retry_cap_s"),  # a pause of minutes stalls the load it retries
        ({"request_checksum_calculation": "always"}, "request_checksum_calculation"),
        ({"response_checksum_validation": "WHEN_REQUIRED"}, "response_checksum_validation"),
    ],
)
def test_s3_invalid_values_are_named(overrides, named):
    message = _error(_s3(**overrides))
    assert named in message


@pytest.mark.parametrize("overrides,named", [({"root": ""}, "root"), ({"io_timeout_s": 0.0}, "io_timeout_s")])
def test_posix_invalid_values_are_named(tmp_path, overrides, named):
    message = _error(_posix(tmp_path, **overrides))
    assert named in message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- the secret never shows ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_secret",
    [[SECRET], {"value": SECRET}, (SECRET,), SECRET.encode()],
    ids=["list", "dict", "tuple", "bytes"],
)
def test_bad_secret_value_is_not_in_the_message(bad_secret):
    message = _error(_s3(access_key="AKIA", secret_key=bad_secret))
    assert "'secret_key'" in message
    assert SECRET not in message
    assert SECRET.encode().hex() not in message


def test_bad_secret_value_not_leaked_by_from_dict_directly():
    with pytest.raises(ConfigError) as info:
        from_dict(S3StoreConfig, {"bucket": "my-bucket", "access_key": "AKIA", "secret_key": [SECRET]}, "x.")
    assert "x.'secret_key'" in str(info.value)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value)


def test_secret_not_in_error_raised_for_another_key():
    message = _error(_s3(access_key="AKIA", secret_key=SECRET, io_threads="many"))
    assert "'io_threads'" in message
    assert SECRET not in message


def test_repr_of_parsed_s3_config_hides_secret():
    config = parse_store_config(_s3(access_key="AKIA", secret_key=SECRET))
    assert config.secret_key == SECRET
    assert SECRET not in repr(config)
    assert SECRET not in str(config)
    assert SECRET not in f"{config}"
    # The access key is not a secret and stays visible for debugging.
    assert "AKIA" in repr(config)


def test_secret_key_field_is_excluded_from_repr():
    (secret_field,) = [f for f in dataclasses.fields(S3StoreConfig) if f.name == "secret_key"]
    assert secret_field.repr is False


@pytest.mark.parametrize("value", ["when_required", "when_supported"])
def test_the_sdk_checksum_settings_reach_nixl_obj(monkeypatch, value):
    """NIXL OBJ's names for the SDK's settings: req_checksum / resp_checksum, "required" or "supported"."""
    config = parse_store_config(_s3(request_checksum_calculation=value, response_checksum_validation=value))
    created = _obj_params(monkeypatch, config)
    assert (created["req_checksum"], created["resp_checksum"]) == (value.removeprefix("when_"),) * 2


@pytest.mark.parametrize("endpoint,sent", [
    ("http://127.0.0.1:8333", "required"),  # the SDK signs the body over http whatever: no CRC on top
    ("https://s3.example.internal", "supported"),  # unsigned body with a CRC64 trailer instead of its SHA-256
    (None, "supported"),  # AWS S3 itself, over https
])
def test_put_checksums_follow_the_endpoints_scheme_unless_set(monkeypatch, endpoint, sent):
    config = parse_store_config(_s3(endpoint=endpoint))
    assert _obj_params(monkeypatch, config)["req_checksum"] == sent
    pinned = parse_store_config(_s3(endpoint=endpoint, request_checksum_calculation="when_required"))
    assert _obj_params(monkeypatch, pinned)["req_checksum"] == "required"


@pytest.mark.parametrize("s3_endpoint,sent", [
    ("https://gw.internal:9100", "when_required"),  # PUTs through the gateway: it refuses unsigned bodies
    ("https://gw.internal:9100/", "when_required"),
    ("https://GW.internal:9100", "when_required"),
    ("http://gw.internal:9100", "when_required"),  # http: signed whatever
    ("https://gw.internal", "when_supported"),  # port 443: another endpoint on that host
    ("https://s3.internal", "when_supported"),  # PUTs to the bucket's own store
])
def test_an_s3agg_store_signs_put_bodies_it_sends_through_its_gateway(s3_endpoint, sent):
    config = parse_store_config({"backend": "s3agg", "gateway": "https://gw.internal:9100",
                                 "s3": {"bucket": "my-bucket", "endpoint": s3_endpoint}})  # fmt: skip
    assert config.s3_config.request_checksum == sent
    default_port = parse_store_config({"backend": "s3agg", "gateway": "https://gw.internal",
                                       "s3": {"bucket": "my-bucket", "endpoint": "https://gw.internal:443"}})
    assert default_port.s3_config.request_checksum == "when_required"


def _obj_params(monkeypatch, config) -> dict:
    """What add_obj_backend hands NIXL OBJ for ``config``, the AWS chain holding temporary credentials."""
    from nixl_backends import obj_backend

    created = {}
    agent = SimpleNamespace(create_backend=lambda name, params: created.update(params))
    frozen = SimpleNamespace(access_key="ASIA-chain", secret_key="chain-secret", token="chain-token")
    credentials = SimpleNamespace(method="container-role", get_frozen_credentials=lambda: frozen)
    monkeypatch.setattr(obj_backend, "ensure_obj_plugin_loadable", lambda: None)
    obj_backend.add_obj_backend(agent, config, SimpleNamespace(get_credentials=lambda: credentials))
    return created


def test_nixl_obj_gets_configured_keys_and_never_a_snapshot_of_the_chain(monkeypatch):
    """Keys in the section are static and passed; the chain's are left to the plugin's AWS SDK, which renews
    them: a snapshot would fail every request once its token expired."""
    static = _obj_params(monkeypatch, parse_store_config(_s3(access_key="AK", secret_key="SK")))
    assert (static["access_key"], static["secret_key"]) == ("AK", "SK") and "session_token" not in static
    chain = _obj_params(monkeypatch, parse_store_config(_s3()))
    assert not {"access_key", "secret_key", "session_token"} & chain.keys()
