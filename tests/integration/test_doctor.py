"""``dualpath-kv doctor`` against real stores: SeaweedFS on 127.0.0.1 with good and wrong credentials, versitygw
over TLS with its CA and another, a POSIX
root that cannot be written. The command runs as a user runs it (a subprocess; its whole stdout and stderr,
NIXL's own log lines included, are searched for the secret)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from dualpath_dev.processes import free_port
from dualpath_dev.tls import make_server_tls
from dualpath_connector.doctor import diagnose
from nixl_backends.doctor import diagnose_store, exit_code, format_report
from tests.conftest import REPO_ROOT
from tests.s3agg_fixtures import (  # noqa: F401  (fixtures)
    CLIENT_ACCESS_KEY,
    CLIENT_SECRET_KEY,
    gateway,
    s3agg_bucket,
    s3agg_server,
    start_gateway,
)

CLUSTER_KEY = "doctor-test-cluster-key-0123456789abcdef"
WRONG_SECRET = "wrong-secret-for-doctor-test-0123456789"


def doctor(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dualpath_connector.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=180, env=env, cwd=REPO_ROOT)  # fmt: skip


def lines(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """check name -> its status mark and detail ("[OK  ] name: detail")."""
    found = {}
    for line in proc.stdout.splitlines():
        mark, _, rest = line.partition("] ")
        name, _, detail = rest.partition(": ")
        found[name] = f"{mark}] {detail}"
    return found


def environment(access_key: str, secret_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DUALPATH_"))}
    # No AWS config files: the credentials are exactly these.
    return {**env, "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "DUALPATH_CLUSTER_KEY": CLUSTER_KEY, "DUALPATH_INTEGRITY_KEY": CLUSTER_KEY}  # fmt: skip


@pytest.fixture
def pe_config(seaweedfs, s3_bucket) -> str:
    """configs/pe.json pointed at the test server and a fresh bucket (credentials from the environment)."""
    pe = json.loads((REPO_ROOT / "configs" / "pe.json").read_text())
    pe["kv_connector_extra_config"]["store"].update(endpoint=seaweedfs.endpoint, bucket=s3_bucket)
    yield json.dumps(pe)
    client = seaweedfs.client()
    with contextlib.suppress(ClientError):
        for obj in client.list_objects_v2(Bucket=s3_bucket).get("Contents", []):
            client.delete_object(Bucket=s3_bucket, Key=obj["Key"])
        client.delete_bucket(Bucket=s3_bucket)


def test_good_credentials_pass_every_check_and_leave_nothing_behind(seaweedfs, s3_bucket, pe_config):
    proc = doctor("--kv-transfer-config", pe_config, env=environment(seaweedfs.access_key, seaweedfs.secret_key))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    found = lines(proc)
    store = f"store s3 {seaweedfs.endpoint} bucket {s3_bucket!r}"
    assert list(found) == ["config", "cluster key", "rdma devices", "nixl UCX", "nixl POSIX", "nixl OBJ", store,
                           f"{store} writable"]  # fmt: skip
    # No RDMA hardware here (and no pyverbs in the venv): a skip, never a failure, for a config naming no HCA.
    assert found.pop("rdma devices").startswith("[SKIP] "), proc.stdout
    assert all(status.startswith("[OK  ]") for status in found.values()), proc.stdout
    assert found[f"{store} writable"] == "[OK  ] 8224-byte probe object written, read back equal, deleted"
    # The probe went through the bucket and was deleted.
    assert seaweedfs.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    assert seaweedfs.secret_key not in proc.stdout + proc.stderr


def test_a_wrong_secret_fails_the_store_check_without_showing_it(seaweedfs, s3_bucket, pe_config):
    proc = doctor("--kv-transfer-config", pe_config, env=environment(seaweedfs.access_key, WRONG_SECRET))
    assert proc.returncode == 1, proc.stdout
    found = lines(proc)
    store = f"store s3 {seaweedfs.endpoint} bucket {s3_bucket!r}"
    assert found[store].startswith("[FAIL] ") and "refused the credentials" in found[store], proc.stdout
    assert "-> check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in found[store]
    assert f"{store} writable" not in found  # nothing to write to
    assert all(found[name].startswith("[OK  ]") for name in ("config", "cluster key", "nixl OBJ"))
    assert WRONG_SECRET not in proc.stdout + proc.stderr
    # The same secret in the JSON report is not shown either.
    proc = doctor("--kv-transfer-config", pe_config, "--json", env=environment(seaweedfs.access_key, WRONG_SECRET))
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and report["ok"] is False
    assert [c["status"] for c in report["checks"] if c["name"] == store] == ["fail"]
    assert WRONG_SECRET not in proc.stdout + proc.stderr


def test_a_tls_store_passes_with_its_ca_and_fails_naming_ca_bundle_with_another(versitygw, s3_bucket, tmp_path):
    """The second S3 server over TLS: trusted through ``ca_bundle`` every check passes (the probe object goes
    through NIXL OBJ over TLS); with a CA that did not sign its certificate the store check fails, saying so."""
    pe = json.loads((REPO_ROOT / "configs" / "pe.json").read_text())
    pe["kv_connector_extra_config"]["store"].update(endpoint=versitygw.endpoint, bucket=s3_bucket,
                                                    ca_bundle=versitygw.ca_bundle)  # fmt: skip
    env = environment(versitygw.access_key, versitygw.secret_key)
    store = f"store s3 {versitygw.endpoint} bucket {s3_bucket!r}"
    proc = doctor("--kv-transfer-config", json.dumps(pe), env=env)
    found = lines(proc)
    assert proc.returncode == 0 and found[f"{store} writable"].startswith("[OK  ] "), proc.stdout + proc.stderr[-3000:]
    assert versitygw.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0

    pe["kv_connector_extra_config"]["store"]["ca_bundle"] = str(make_server_tls(tmp_path, ["127.0.0.1"]).ca_file)
    proc = doctor("--kv-transfer-config", json.dumps(pe), env=env)
    found = lines(proc)
    assert proc.returncode == 1 and found[store].startswith("[FAIL] "), proc.stdout
    assert "TLS certificate is not trusted" in found[store] and "-> set store.ca_bundle" in found[store]
    assert versitygw.secret_key not in proc.stdout + proc.stderr


def test_no_cluster_key_fails_a_pd_role(seaweedfs, pe_config):
    env = environment(seaweedfs.access_key, seaweedfs.secret_key)
    del env["DUALPATH_CLUSTER_KEY"]
    proc = doctor("--kv-transfer-config", pe_config, env=env)
    assert proc.returncode == 1
    assert lines(proc)["cluster key"].startswith("[FAIL] DUALPATH_CLUSTER_KEY is not set")


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory nobody may write in: mode 0555, or for root (whom modes do not stop) a read-only tmpfs."""
    path = tmp_path / "read-only"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, timeout=30)


def test_an_unwritable_posix_root_fails_the_writable_check(read_only_dir, tmp_path):
    env = environment("unused", "unused-secret")
    proc = doctor("--store", json.dumps({"backend": "posix", "root": str(read_only_dir)}), env=env)
    assert proc.returncode == 1, proc.stdout
    found = lines(proc)
    store = f"store posix {read_only_dir}"
    assert found[store] == "[OK  ] reachable"
    assert found[f"{store} writable"].startswith("[FAIL] "), proc.stdout
    assert "Read-only file system" in found[f"{store} writable"] or "Permission denied" in found[f"{store} writable"]
    assert "-> make the store writable for the engine's user" in found[f"{store} writable"]
    # Negative control: a writable root passes the same check.
    writable = tmp_path / "writable"
    proc = doctor("--store", json.dumps({"backend": "posix", "root": str(writable)}), env=env)
    assert proc.returncode == 0, proc.stdout
    assert lines(proc)[f"store posix {writable} writable"].startswith("[OK  ] ")
    assert list(writable.rglob("*.*")) == []  # the probe file is gone (directories may stay)


def test_an_s3agg_store_checks_its_gateway(seaweedfs, s3agg_bucket, gateway):
    """Through the gateway: reachable, /healthz, and the probe read back through it; a gateway that is not there
    only warns (reads fall back to plain S3), the exit status stays 0."""
    section = {"backend": "s3agg", "gateway": gateway.url, "s3": seaweedfs.store_config(s3agg_bucket),
               "access_key": CLIENT_ACCESS_KEY, "secret_key": CLIENT_SECRET_KEY}  # fmt: skip
    results = {r.name: r for r in diagnose_store(section)}
    store = f"store s3agg gateway {gateway.url}, bucket {s3agg_bucket!r}"
    assert [results[name].status for name in (store, f"gateway {gateway.url}", f"{store} writable")] == ["ok"] * 3
    assert exit_code(list(results.values())) == 0
    assert CLIENT_SECRET_KEY not in format_report(list(results.values()))

    nowhere = f"http://127.0.0.1:{free_port()}"
    results = {r.name: r for r in diagnose_store({**section, "gateway": nowhere})}
    assert results[f"gateway {nowhere}"].status == "warn", results
    assert "reads fall back to plain S3 GETs" in results[f"gateway {nowhere}"].detail
    assert exit_code(list(results.values())) == 0
