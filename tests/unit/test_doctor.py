"""``dualpath-kv doctor``'s parsing, redaction and report format (the checks against real stores:
tests/integration/test_doctor.py)."""

from __future__ import annotations

import json

import pytest

from dualpath_connector.cli import main
from dualpath_connector.doctor import connector_section, diagnose, parse_target
from nixl_backends.configuration import ConfigError
from nixl_backends.doctor import (
    FAIL,
    OK,
    REDACTED,
    SKIP,
    WARN,
    CheckResult,
    Redactor,
    exit_code,
    format_line,
    format_report,
)
from nixl_backends.s3_endpoint import S3StoreConfig
from tests.conftest import REPO_ROOT

SECRET = "wJalrXUtnFEMI-doctor-test-secret"


@pytest.fixture(autouse=True)
def integrity_secret(monkeypatch):
    """configs/ run integrity: keyed, which needs the deployment's secret to parse."""
    monkeypatch.setenv("DUALPATH_INTEGRITY_KEY", "doctor-test-integrity-secret-0123")


def config(name: str) -> dict:
    return json.loads((REPO_ROOT / "configs" / name).read_text())


# -- which part of a document is the connector's -----------------------------------------------------------


def test_a_whole_kv_transfer_config_gives_its_extra_config_and_role():
    pe = config("pe.json")
    assert connector_section(pe, None) == (pe["kv_connector_extra_config"], "kv_producer")
    assert connector_section(pe, "kv_both") == (pe["kv_connector_extra_config"], "kv_both")  # --kv-role wins


def test_the_extra_config_alone_is_kv_both_unless_told():
    extra = config("single.json")["kv_connector_extra_config"]
    assert connector_section(extra, None) == (extra, "kv_both")
    assert connector_section(extra, "kv_consumer") == (extra, "kv_consumer")


def test_a_multiconnector_child_is_found():
    child = config("de.json")
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
             "kv_connector_extra_config": {"connectors": [{"kv_connector": "OtherConnector"}, child]}}  # fmt: skip
    assert connector_section(multi, None) == (child["kv_connector_extra_config"], "kv_consumer")


@pytest.mark.parametrize(
    "document, message",
    [
        ([1, 2], "must be a JSON object, got list"),
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "kv_connector is 'LMCacheConnectorV1'"),
        ({"kv_connector": "DualPathConnector", "kv_connector_extra_config": {}}, "missing kv_role"),
        ({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": []}},
         "must hold one DualPathConnector, found 0"),
    ],
)  # fmt: skip
def test_documents_that_are_not_a_dualpath_config(document, message):
    with pytest.raises(ConfigError, match=message):
        connector_section(document, None)


# -- parsing with the connector's own parser ---------------------------------------------------------------


def test_the_repos_configs_parse_as_the_engine_parses_them():
    target = parse_target(config("pe.json"))
    assert (target.kv_role, target.key_prefix) == ("kv_producer", "dualpath")
    assert isinstance(target.store, S3StoreConfig) and target.store.bucket == "dualpath-kv"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"chunk_token": 32}, "unknown key kv_connector_extra_config.'chunk_token'"),
        ({"side_channel_port": None}, "side_channel_port is required with kv_role 'kv_producer'"),
        ({"store": {"backend": "nfs"}}, "bad value for kv_connector_extra_config.store.'backend'"),
    ],
)
def test_a_bad_key_fails_naming_it(change, message):
    pe = config("pe.json")
    pe["kv_connector_extra_config"].update(change)
    with pytest.raises(ConfigError, match=message):
        parse_target(pe)


def test_a_config_that_does_not_parse_fails_that_check_and_skips_the_store():
    results = diagnose({"store": {"backend": "posix"}})
    assert results[0].name == "config" and results[0].status == FAIL
    assert "missing required key kv_connector_extra_config.store.'root'" in results[0].detail
    assert results[0].fix  # says where to look
    assert results[-1] == CheckResult("store", SKIP, "the configuration did not parse")
    assert exit_code(results) == 1


def test_a_secret_in_the_config_is_refused_and_never_shown():
    """The connector refuses store.secret_key (vLLM logs the extra config); the doctor's output leaves it out."""
    single = config("single.json")
    single["kv_connector_extra_config"]["store"].update(access_key="AKIDDOCTOR", secret_key=SECRET)
    results = diagnose(single)
    assert results[0].status == FAIL and "store.secret_key would be written to vLLM's start-up log" in results[0].detail
    for as_json in (False, True):
        assert SECRET not in format_report(results, as_json=as_json)


# -- redaction ------------------------------------------------------------------------------------------------


def test_the_redactor_removes_configured_and_environment_secrets():
    redact = Redactor({"AWS_SECRET_ACCESS_KEY": "env-secret-value", "AWS_ACCESS_KEY_ID": "AKIDVISIBLE"})
    redact.add_from_document({"store": {"tiers": [{"s3": {"secret_key": SECRET}}], "session_token": "tok-12345"}})
    text = f"refused {SECRET} / env-secret-value / tok-12345 / AKIDVISIBLE"
    assert redact(text) == f"refused {REDACTED} / {REDACTED} / {REDACTED} / AKIDVISIBLE"
    # Negative control: without the redactor the secrets are in the text.
    assert SECRET in text
    result = redact.result(CheckResult("store", FAIL, f"bad {SECRET}", f"not {SECRET}"))
    assert SECRET not in result.detail + result.fix
    assert Redactor({}).__call__("a b") == "a b"
    short = Redactor({})
    short.add("ab")  # too short to be a secret: never blanks out ordinary words
    assert short("ab cab") == "ab cab"


# -- the report ---------------------------------------------------------------------------------------------


def test_one_line_per_check_with_the_fix_on_failures_only():
    assert format_line(CheckResult("nixl UCX", OK, "backend created", "ignored")) == "[OK  ] nixl UCX: backend created"
    assert format_line(CheckResult("store x", FAIL, "refused (403)", "check the keys")) == (
        "[FAIL] store x: refused (403) -> check the keys")
    assert format_line(CheckResult("nixl OBJ", WARN, "missing", "install")) == "[WARN] nixl OBJ: missing -> install"
    results = [CheckResult("a", OK, "fine"), CheckResult("b", WARN, "unused plugin", "install it")]
    assert format_report(results).splitlines() == ["[OK  ] a: fine", "[WARN] b: unused plugin -> install it"]
    assert exit_code(results) == 0  # a warning does not fail
    assert exit_code([*results, CheckResult("c", FAIL, "no")]) == 1


def test_json_report():
    results = [CheckResult("a", OK, "fine"), CheckResult("b", FAIL, "broken", "fix it")]
    assert json.loads(format_report(results, as_json=True)) == {
        "ok": False,
        "checks": [{"name": "a", "status": "ok", "detail": "fine", "fix": ""},
                   {"name": "b", "status": "fail", "detail": "broken", "fix": "fix it"}],
    }  # fmt: skip


# -- the command line ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["doctor"], "one of the arguments --kv-transfer-config --config-file --store is required"),
        (["doctor", "--kv-transfer-config", '{"store": ' + SECRET], "--kv-transfer-config: not JSON"),
        (["doctor", "--config-file", "/nonexistent/pe.json"], "--config-file: cannot read '/nonexistent/pe.json'"),
        (["doctor", "--store", json.dumps({"backend": "s3", "bucket": "kv", "secret_key": SECRET})],
         "--store: store.secret_key is not accepted here"),
        (["doctor", "--config-file", "x", "--kv-role", "kv_decoder"], "invalid choice: 'kv_decoder'"),
    ],
)  # fmt: skip
def test_bad_arguments_exit_2_naming_the_option_without_echoing_secrets(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert SECRET not in err
