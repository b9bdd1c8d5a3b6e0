"""The connector against vLLM's newest release (a CUDA build, installed beside the CPU build without its
dependencies): every check of ``tests/vllm_latest.py`` that needs no GPU, each its own test here.

The checks run in one process whose ``import vllm`` is the release (``tests/vllm_latest.py`` says how); this
module installs it if ``make vllm-latest`` has not. A check that needs what this machine lacks is skipped with
the exact reason (here ``cpu_kernels``: a CUDA build has no CPU kernels, so no forward runs against the release);
the whole tier is skipped only when the package index cannot be reached. The tests after the
checks show that the install's outcome is told apart: an index that cannot be reached from one that answers
without the release (a failure).
"""

from __future__ import annotations

import functools
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from dualpath_dev.processes import free_port
from tests import vllm_latest as latest
from tests.conftest import REPO_ROOT

# A bound, never reached when all is well (the checks take well under a minute of CPU): a hung check fails.
CHECKS_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def report(tiny_model, tmp_path_factory) -> dict[str, latest.Outcome]:
    outcome = latest.install(latest.UV)
    if not outcome.installed:
        if outcome.unreachable:
            pytest.skip(f"vllm=={latest.VERSION} not installed, the package index out of reach:\n{outcome.output}")
        pytest.fail(f"vllm=={latest.VERSION} could not be installed, and not for want of the index:\n{outcome.output}")
    path = tmp_path_factory.mktemp("vllm-latest") / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_latest", "check", str(path), str(tiny_model)],
        cwd=REPO_ROOT, env=latest.check_environment(), capture_output=True, text=True, timeout=CHECKS_TIMEOUT_S,
    )  # fmt: skip
    if done.returncode != 0 or not path.exists():
        output = f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        pytest.fail(f"the checks' process failed (exit {done.returncode}):\n{output}")
    return {entry["check"]: latest.Outcome(**entry) for entry in json.loads(path.read_text())}


@pytest.mark.parametrize("check", list(latest.CHECKS))
def test_against_the_newest_vllm(report, check):
    outcome = report[check]
    if outcome.status == "skipped":
        pytest.skip(f"vLLM {latest.VERSION}, {check}: cannot run here: {outcome.detail}")
    assert outcome.status == "passed", f"vLLM {latest.VERSION}, {check}:\n{outcome.detail}"


# -- how an install's failure is judged ------------------------------------------------------------------------


def test_an_index_that_cannot_be_reached_is_a_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")  # uv would retry a refused connection for seconds
    target = tmp_path / f"vllm-{latest.VERSION}"
    outcome = latest.install(latest.UV, target, index_url=f"http://127.0.0.1:{free_port()}/simple")
    assert not outcome.installed and outcome.unreachable, outcome.output
    assert not target.exists() and "127.0.0.1" in outcome.output


@pytest.fixture
def index_without_vllm(tmp_path) -> Iterator[str]:
    """A package index on 127.0.0.1 that answers, and lists no file of vllm."""
    (tmp_path / "simple" / "vllm").mkdir(parents=True)
    (tmp_path / "simple" / "vllm" / "index.html").write_text("<!DOCTYPE html><html><body></body></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()
    server.server_close()
    thread.join()


def test_an_index_that_answers_without_the_release_is_a_failure(tmp_path, index_without_vllm):
    target = tmp_path / "install" / f"vllm-{latest.VERSION}"
    outcome = latest.install(latest.UV, target, index_url=index_without_vllm)
    assert not outcome.installed and not outcome.unreachable, outcome.output
    assert not target.exists()


@pytest.mark.parametrize(
    ("error", "machine_limit"),
    [
        (ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer"), True),
        (OSError("_C.abi3.so: undefined symbol: _ZN3c104cuda"), True),
        (ModuleNotFoundError("No module named 'vllm.v1.core.sched'", name="vllm.v1.core.sched"), False),
        (ImportError("cannot import name 'KVConnectorBase_V1' from 'vllm.distributed.kv_transfer'"), False),
        (AssertionError("scheduled 0 tokens"), False),
    ],
    ids=["third-party module", "compiled extension", "vllm module", "vllm name", "assertion"],
)
def test_only_what_this_machine_lacks_skips_a_check(error, machine_limit):
    try:
        raise RuntimeError("while running a check") from error
    except RuntimeError as raised:
        assert (latest.cannot_run_here(raised) is not None) is machine_limit
