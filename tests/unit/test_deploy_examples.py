"""examples/deploy/: the compose file and the Dockerfile cannot run here (no docker, no GPU), so they are read:
every config they name exists in the repo, their ports, host names and side channels agree with configs/pe.json,
de.json, router.yaml and gateway.yaml as each service's DUALPATH_CONFIG_PATCH changes them, only the router is
published, and no secret is written in them. Each rule has a negative control
(a broken copy is caught). The image's entrypoint is a shell script and does run here, on real processes.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from nixl_backends.config_patch import PATCH_ENV, merge_patch
from tests.conftest import REPO_ROOT

DEPLOY = REPO_ROOT / "examples" / "deploy"
CONFIGS = REPO_ROOT / "configs"
SECRET_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|(^|_)KEY($|_)", re.I)
# Config keys that hold a secret (a ${VAR} reference is fine): secret_key, session_token, password, api_key.
SECRET_KEY = re.compile(r"secret|password|(^|_)token$|api_key$", re.I)
SERVICES = {"pe", "de", "router", "s3agg-gateway"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def _default(value: str) -> str:
    """``${NAME:-default}`` -> default (compose's interpolation of an unset variable)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def _option(command: list[str], name: str) -> str:
    return _default(command[command.index(name) + 1])


def _health_port(service: dict) -> int:
    (url,) = re.findall(r"http://[^'\"]+", " ".join(service["healthcheck"]["test"]))
    return urlsplit(url).port


def _mounted(compose: dict, service: str) -> dict[str, Path]:
    """target path in the container -> the repo file compose mounts there."""
    declared = compose["configs"]
    return {c["target"]: (DEPLOY / declared[c["source"]]["file"]).resolve() for c in compose["services"][service]["configs"]}


def _config(compose: dict, service: str, target: str) -> dict:
    """The config ``service`` reads at ``target``: the mounted file with the service's DUALPATH_CONFIG_PATCH."""
    config = yaml.safe_load(_mounted(compose, service)[target].read_text())  # JSON is YAML
    patch = (compose["services"][service].get("environment") or {}).get(PATCH_ENV)
    return merge_patch(config, json.loads(_default(patch))) if patch else config


def _engine_config(compose: dict, service: str) -> dict:
    return _config(compose, service, compose["services"][service]["environment"]["DUALPATH_KV_CONFIG"])


# -- the rules ------------------------------------------------------------------------------------------------


def missing_files(compose: dict) -> list[str]:
    """Configs compose names that are not in the repository (or lie outside it)."""
    problems = []
    for name, entry in compose["configs"].items():
        path = (DEPLOY / entry["file"]).resolve()
        if not path.is_file() or not path.is_relative_to(REPO_ROOT):
            problems.append(f"config {name}: {entry['file']}")
    for service, body in compose["services"].items():
        for config in body.get("configs", []):
            if config["source"] not in compose["configs"]:
                problems.append(f"{service}: undeclared config {config['source']}")
        for secret in body.get("secrets", []):
            if (secret["source"] if isinstance(secret, dict) else secret) not in compose["secrets"]:
                problems.append(f"{service}: undeclared secret {secret}")
    return problems


def port_mismatches(compose: dict) -> list[str]:
    services = compose["services"]
    router = _config(compose, "router", "/etc/dualpath/router.yaml")
    gateway = _config(compose, "s3agg-gateway", "/etc/dualpath/gateway.yaml")
    pe, de = _engine_config(compose, "pe"), _engine_config(compose, "de")
    pe_extra, de_extra = pe["kv_connector_extra_config"], de["kv_connector_extra_config"]
    pe_port, de_port = int(_option(services["pe"]["command"], "--port")), int(_option(services["de"]["command"], "--port"))
    (pe_entry,), (de_entry,) = router["prefill_engines"], router["decode_engines"]
    checks = {
        "PE role": (pe["kv_role"], "kv_producer"),
        "DE role": (de["kv_role"], "kv_consumer"),
        "router -> PE url": (urlsplit(pe_entry["url"])[1], f"pe:{pe_port}"),
        "router -> DE url": (urlsplit(de_entry["url"])[1], f"de:{de_port}"),
        "PE side channel host": (pe_extra["side_channel_host"], "pe"),
        "router -> DE side channel": (de_entry["side_channel"], f"{de_extra['side_channel_host']}:{de_extra['side_channel_port']}"),
        "PE healthcheck port": (_health_port(services["pe"]), pe_port),
        "DE healthcheck port": (_health_port(services["de"]), de_port),
        "router healthcheck port": (_health_port(services["router"]), router["port"]),
        "gateway healthcheck port": (_health_port(services["s3agg-gateway"]), gateway["port"]),
        "served model name": (_option(services["pe"]["command"], "--served-model-name") in router["served_model_names"]
                              and _option(services["de"]["command"], "--served-model-name") in router["served_model_names"], True),
        "one store": (len({pe_extra["store"]["endpoint"], de_extra["store"]["endpoint"], router["store"]["endpoint"],
                           gateway["store"]["endpoint"]}), 1),
    }  # fmt: skip
    problems = [f"{what}: {got!r} != {want!r}" for what, (got, want) in checks.items() if got != want]
    # Only the router is reachable from outside the host, at the port it listens on in its container.
    published = {name: [_default(p) for p in body.get("ports", [])] for name, body in services.items()}
    if published != {**{name: [] for name in services}, "router": [f"8000:{router['port']}"]}:
        problems.append(f"published ports: {published}")
    return problems


def inline_secrets(compose: dict, dockerfile: str) -> list[str]:
    """Secret-named variables given a value, secrets not read from ./secrets/ files, secrets in a config."""
    problems = []
    for service, body in compose["services"].items():
        environment = body.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        problems += [f"{service}: {name} set inline" for name, value in environment.items()
                     if SECRET_NAME.search(name) and value not in (None, "")]  # fmt: skip
        problems += [f"{service}: secret in its command: {arg}" for arg in body.get("command", [])
                     if SECRET_NAME.search(arg.split("=")[0]) and "=" in arg]  # fmt: skip
    for name, entry in compose["secrets"].items():
        if set(entry) != {"file"} or not entry["file"].startswith("./secrets/"):
            problems.append(f"secret {name}: {entry} (only ./secrets/ files)")
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] in (["ENV"], ["ARG"]) and SECRET_NAME.search(words[1].split("=")[0]):
            problems.append(f"Dockerfile: {line.strip()}")
    for name, entry in compose["configs"].items():
        for key, value in _items(yaml.safe_load((DEPLOY / entry["file"]).read_text())):  # JSON is YAML
            if SECRET_KEY.search(key) and not re.fullmatch(r"\$\{\w+\}", str(value)):
                problems.append(f"config {name}: {key} has a literal value")
    return problems


def _items(document: object) -> list[tuple[str, object]]:
    """Every (key, value) of a parsed config, at any depth."""
    if isinstance(document, dict):
        return [pair for key, value in document.items() for pair in [(str(key), value), *_items(value)]]
    if isinstance(document, list):
        return [pair for item in document for pair in _items(item)]
    return []


# -- the repo's files pass ------------------------------------------------------------------------------------


def test_the_stack_has_its_four_services_on_its_own_network(compose):
    assert set(compose["services"]) == SERVICES
    assert all("network_mode" not in s and "cluster" in s["networks"] for s in compose["services"].values())
    assert [name for name, s in compose["services"].items() if "edge" in s["networks"]] == ["router"]


def test_every_config_compose_names_is_in_the_repo(compose):
    assert missing_files(compose) == []
    assert {path.name for service in SERVICES for path in _mounted(compose, service).values()} == {
        "pe.json", "de.json", "router.yaml", "gateway.yaml"}  # fmt: skip


def test_ports_and_side_channels_agree_with_the_configs(compose):
    assert port_mismatches(compose) == []


def test_no_secret_is_inline(compose):
    assert inline_secrets(compose, (DEPLOY / "Dockerfile").read_text()) == []
    # The secret files themselves are never committed.
    assert "secrets/" in (DEPLOY / ".gitignore").read_text().split()
    tracked = subprocess.run(["git", "ls-files", "examples/deploy/secrets"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=30).stdout  # fmt: skip
    assert tracked == ""


def test_the_dockerfile_installs_dualpath_kv_on_a_vllm_image():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:\S+$", dockerfile, re.M)
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", dockerfile, re.M)
    assert 'ARG DUALPATH_KV="dualpath-kv[router,gateway]"' in dockerfile and 'pip install --no-cache-dir "${DUALPATH_KV}"' in dockerfile
    for source, target in re.findall(r"^COPY (\S+) (\S+)$", dockerfile, re.M):
        assert (DEPLOY / source).is_file(), source
        assert f'ENTRYPOINT ["{target}"]' in dockerfile


# -- negative controls: each rule catches a broken copy ----------------------------------------------------------


def test_a_missing_config_is_caught(compose):
    broken = copy.deepcopy(compose)
    broken["configs"]["pe"]["file"] = "../../configs/pe-missing.json"
    broken["services"]["de"]["configs"][0]["source"] = "nope"
    assert missing_files(broken) == ["config pe: ../../configs/pe-missing.json", "de: undeclared config nope"]


@pytest.mark.parametrize(
    "service, index, value, expected",
    [
        ("pe", 4, "8101", "router -> PE url: 'pe:8100' != 'pe:8101'"),
        ("de", 4, "8100", "router -> DE url: 'de:8200' != 'de:8100'"),
    ],
)
def test_a_port_mismatch_is_caught(compose, service, index, value, expected):
    broken = copy.deepcopy(compose)
    assert broken["services"][service]["command"][index - 1] == "--port"
    broken["services"][service]["command"][index] = value
    assert expected in port_mismatches(broken)


def test_a_side_channel_mismatch_is_caught(compose, tmp_path):
    de = json.loads((CONFIGS / "de.json").read_text())
    de["kv_connector_extra_config"]["side_channel_port"] = 5600  # the PE's
    (tmp_path / "de.json").write_text(json.dumps(de))
    broken = copy.deepcopy(compose)
    broken["configs"]["de"]["file"] = str(tmp_path / "de.json")
    assert port_mismatches(broken) == ["router -> DE side channel: 'de:5700' != 'de:5600'"]


def test_a_wrong_host_name_or_a_published_engine_is_caught(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["pe"]["environment"]["DUALPATH_CONFIG_PATCH"] = '{"kv_connector_extra_config": {}}'
    broken["services"]["de"]["ports"] = ["8200:8200"]
    assert port_mismatches(broken) == [
        "PE side channel host: '127.0.0.1' != 'pe'",
        "one store: 2 != 1",
        "published ports: {'pe': [], 'de': ['8200:8200'], 'router': ['8000:8000'], 's3agg-gateway': []}",
    ]


def test_an_inline_secret_is_caught(compose, tmp_path):
    broken = copy.deepcopy(compose)
    broken["services"]["pe"]["environment"]["AWS_SECRET_ACCESS_KEY"] = "abc123"
    broken["services"]["router"]["environment"] = ["VLLM_API_KEY=k", "LOG_LEVEL=info"]
    broken["secrets"]["vllm_api_key"] = {"environment": "VLLM_API_KEY"}
    broken["configs"]["gateway"]["file"] = str(tmp_path / "gateway.yaml")
    gateway = yaml.safe_load((CONFIGS / "gateway.yaml").read_text())
    gateway["store"]["secret_key"] = "literal-secret"
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(gateway))
    problems = inline_secrets(broken, "ENV HF_TOKEN=hf_abc\nENV PATH=/x\n")
    assert problems == [
        "pe: AWS_SECRET_ACCESS_KEY set inline",
        "router: VLLM_API_KEY set inline",
        "secret vllm_api_key: {'environment': 'VLLM_API_KEY'} (only ./secrets/ files)",
        "Dockerfile: ENV HF_TOKEN=hf_abc",
        "config gateway: secret_key has a literal value",
    ]


# -- the entrypoint, run -----------------------------------------------------------------------------------------


def entrypoint(*command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    bin_dir = os.path.dirname(sys.executable)  # dualpath-kv and mma-run of this environment
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DUALPATH_", "AWS_", "MMA_", "LD_PRELOAD"))}
    return subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), *command], capture_output=True, text=True, timeout=120,
                          env={**base, "PATH": f"{bin_dir}:{base['PATH']}", **env})  # fmt: skip


def test_the_entrypoint_turns_secret_files_into_variables(tmp_path):
    (tmp_path / "aws_secret_access_key").write_text("from-the-file")
    (tmp_path / "dualpath_engine_api_key").write_text("engine-key")
    (tmp_path / "not a name").write_text("x")
    show = 'echo "$AWS_SECRET_ACCESS_KEY|$DUALPATH_ENGINE_API_KEY"'
    proc = entrypoint("sh", "-c", show, env={"DUALPATH_SECRETS_DIR": str(tmp_path)})
    assert (proc.returncode, proc.stdout.strip()) == (0, "from-the-file|engine-key"), proc.stderr
    assert "skipping" in proc.stderr and "not a name" in proc.stderr
    # A variable already set wins over the file.
    proc = entrypoint("sh", "-c", show, env={"DUALPATH_SECRETS_DIR": str(tmp_path), "AWS_SECRET_ACCESS_KEY": "env"})
    assert proc.stdout.strip() == "env|engine-key"
    assert entrypoint(env={"DUALPATH_SECRETS_DIR": str(tmp_path)}).returncode == 2  # no command: usage


def test_the_entrypoint_appends_the_engine_config_and_can_preload(tmp_path):
    config = CONFIGS / "single.json"
    env = {"DUALPATH_SECRETS_DIR": str(tmp_path), "DUALPATH_KV_CONFIG": str(config), "DUALPATH_DOCTOR": "0"}
    proc = entrypoint(sys.executable, "-c", "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ.get('LD_PRELOAD', '')]))",
                      "serve", env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["serve", "--kv-transfer-config", config.read_text().rstrip("\n")], ""]  # $(cat)
    proc = entrypoint(sys.executable, "-c", "import os; print(os.environ['LD_PRELOAD'])", env={**env, "DUALPATH_MMA": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().split(":")[0].endswith("libmma_preload.so")


def test_the_entrypoint_runs_the_doctor_first_and_stops_on_a_failure(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kv_connector": "DualPathConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"store": {"backend": "posix"}}}))  # fmt: skip
    marker = tmp_path / "ran"
    proc = entrypoint("touch", str(marker), env={"DUALPATH_SECRETS_DIR": str(tmp_path), "DUALPATH_KV_CONFIG": str(bad)})
    assert proc.returncode == 1
    assert "[FAIL] config: missing required key kv_connector_extra_config.store.'root'" in proc.stdout
    assert not marker.exists()


def test_the_entrypoint_patches_the_config_it_hands_on(tmp_path, compose):
    """Each service's DUALPATH_CONFIG_PATCH, as compose gives it, reaches the config the service reads."""
    env = {"DUALPATH_SECRETS_DIR": str(tmp_path), "DUALPATH_DOCTOR": "0", "TMPDIR": str(tmp_path)}  # patched copies
    pe = compose["services"]["pe"]["environment"]
    proc = entrypoint(sys.executable, "-c", "import sys; print(sys.argv[-1])", "serve",
                      env={**env, "DUALPATH_KV_CONFIG": str(CONFIGS / "pe.json"), PATCH_ENV: _default(pe[PATCH_ENV])})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == _engine_config(compose, "pe")
    assert json.loads(proc.stdout)["kv_connector_extra_config"]["side_channel_host"] == "pe"
    # Router and gateway: the file after --config is replaced by its patched copy, the other arguments kept.
    router = compose["services"]["router"]["environment"]
    show = "import json, sys, yaml; print(json.dumps([sys.argv[1:], yaml.safe_load(open(sys.argv[2]))]))"
    proc = entrypoint(sys.executable, "-c", show, "--config", str(CONFIGS / "router.yaml"), "--x y",
                      env={**env, PATCH_ENV: _default(router[PATCH_ENV])})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (flag, path, other), config = json.loads(proc.stdout)
    assert (flag, Path(path).name, other) == ("--config", "router.yaml", "--x y") and Path(path).parent != CONFIGS
    assert config == _config(compose, "router", "/etc/dualpath/router.yaml") and config["host"] == "0.0.0.0"
    # A patch that is not a JSON object, or one with no config to patch, stops the container before its command.
    marker = tmp_path / "ran"
    for patch, args in (("[1]", ["--config", str(CONFIGS / "router.yaml")]), ('{"host": "x"}', [])):
        proc = entrypoint("touch", str(marker), *args, env={**env, PATCH_ENV: patch})
        assert proc.returncode == 2 and PATCH_ENV in proc.stderr, proc.stderr
        assert not marker.exists()


def test_a_merge_patch_merges_objects_replaces_the_rest_and_null_removes():
    # RFC 7396's examples, and the originals are left unchanged.
    target = {"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]}
    assert merge_patch(target, {"a": "z", "c": {"f": None, "h": 1}, "l": [3]}) == {"a": "z", "c": {"d": "e", "h": 1}, "l": [3]}
    assert target == {"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]}
    assert merge_patch({"a": [{"b": "c"}]}, {"a": [1]}) == {"a": [1]}
    assert merge_patch({"a": "foo"}, {"a": {"b": "c"}}) == {"a": {"b": "c"}}
    assert merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}
