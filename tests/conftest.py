"""Shared fixtures: a real SeaweedFS on 127.0.0.1, the tiny test models, an engine without a connector
(one per session), NIXL agents; and the helpers test modules import from here (the checkout's root, an
example as a module, a POST, a poll, output comparison, a resealed stored chunk, a PD pair).

Everything a fixture starts it stops in its finalizer, by the PID it holds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dualpath_dev.cluster import netns_supported, remove
from dualpath_dev.engines import VLLMServer
from dualpath_dev.processes import ServiceProcess, free_port, start_all
from dualpath_dev.s3_server import S3Server
from dualpath_dev.seaweedfs import SeaweedFS
from dualpath_dev.versitygw import VersityGW
from dualpath_dev.tiny_model import make_tiny_deepseek_v2, make_tiny_llama
from nixl_backends.integrity import INTEGRITY_KEY_ENV, ChunkIntegrity, derived_integrity_key
from nixl_backends.layout import DIGEST_BYTES, BlockLayout
from tests.vllm_engine import Engine

REPO_ROOT = Path(__file__).resolve().parent.parent
_agent_names = itertools.count()

# The deployment secret of every engine and store a test starts without its own: integrity defaults to
# "keyed", which refuses to start without one. Set for the test session's processes; a test that needs it
# absent removes it with monkeypatch (restored after). Engines of a PD cluster take their ClusterKeys' secret.
TEST_INTEGRITY_SECRET = "dualpath-kv test suite integrity secret"
os.environ.setdefault(INTEGRITY_KEY_ENV, TEST_INTEGRITY_SECRET)
TEST_INTEGRITY_KEY = derived_integrity_key(os.environ[INTEGRITY_KEY_ENV])


# Per test module, its seconds in the last timed `make test` (the file's "seconds per test module" section).
MODULE_SECONDS_FILE = REPO_ROOT / "benchmarks" / "results" / "make-test-durations.txt"


def measured_module_seconds(text: str) -> dict[str, float]:
    """``module -> seconds`` from a durations file's per-module section (``  708.7 tests.e2e.test_x``)."""
    _, _, section = text.partition("# seconds per test module")
    seconds = {}
    for line in section.splitlines()[1:]:
        fields = line.split()
        if len(fields) == 2 and fields[1].startswith("tests."):
            seconds[fields[1]] = float(fields[0])
    return seconds


def pytest_collection_modifyitems(session, config, items) -> None:
    """Longest modules first, as last measured: xdist hands out whole files (``--dist loadfile
    --no-loadscope-reorder``, the Makefile's) in this order, so the run ends with short modules on both
    workers instead of one long module on one of them."""
    try:
        seconds = measured_module_seconds(MODULE_SECONDS_FILE.read_text())
    except OSError:
        return
    items.sort(key=lambda item: -seconds.get(item.module.__name__ if item.module else "", 0.0))


def load_example(name: str):
    """A script of ``examples/`` as a module (examples are not installed packages)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", REPO_ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def post(url: str, body: dict, headers: dict[str, str] | None = None,
         timeout_s: float = 300.0) -> tuple[int, dict, dict[str, str]]:  # fmt: skip
    """POST JSON: (status, JSON answer, x-dualpath-* headers), whatever the status."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw, got = response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read(), exc.headers
    dualpath = {k.lower(): v for k, v in got.items() if k.lower().startswith("x-dualpath")}
    return status, json.loads(raw), dualpath


def poll(read: Callable[[], object], done: Callable[[object], bool], timeout_s: float, what: str) -> object:
    """Read until ``done(value)``; AssertionError naming ``what`` and the last value after ``timeout_s``.

    Every 0.2 s: what is read here is a server's /metrics or state, each read a request to a busy process.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still {value!r} after {timeout_s:.0f}s")
        time.sleep(0.2)


NETNS_OK, NETNS_WHY = netns_supported()
# Tests that build network namespaces (the emulated cluster's network, the traffic-isolation bench).
needs_netns = pytest.mark.skipif(not NETNS_OK, reason=f"network namespaces not allowed here: {NETNS_WHY}")


@pytest.fixture
def prefix():
    """A fresh network-namespace prefix; whatever a failing test left under it is removed afterwards."""
    name = f"dpb{os.urandom(3).hex()[:5]}"
    yield name
    if NETNS_OK:
        remove(name)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def versitygw(tmp_path_factory):
    """The second S3 server: versitygw over TLS, trusted through its per-run CA (``ca_bundle``)."""
    server = VersityGW(tmp_path_factory.mktemp("versitygw")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(seaweedfs) -> str:
    """A fresh bucket name per test (the store creates it)."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random Llama, made once per checkout (seeded, so always the same weights)."""
    return make_tiny_llama(REPO_ROOT / ".cache" / "tiny-llama")


# The step (max_num_batched_tokens) of ``plain_engine``: a comparison with it needs the same chunking.
PLAIN_ENGINE_BATCH_TOKENS = 512


@pytest.fixture(scope="session")
def plain_engine(tiny_model):
    """The tiny Llama without any KV connector, the reference of every module that compares against one.

    Shared by the session: an engine start costs 40-90 s here, and a greedy
    output does not depend on what the engine served before once its prefix
    cache is reset (each ``generate`` resets it unless told otherwise).
    """
    # LoRA enabled (adapters by request only): plain requests compute bit for bit as without it.
    with Engine(tiny_model, max_num_batched_tokens=PLAIN_ENGINE_BATCH_TOKENS, max_loras=2) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_mla_model() -> Path:
    """The tiny random DeepSeek-V2-style MLA model, made once per checkout like ``tiny_model``."""
    return make_tiny_deepseek_v2(REPO_ROOT / ".cache" / "tiny-deepseek-v2")


@pytest.fixture
def nixl_agent():
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"test-{os.getpid()}-{next(_agent_names)}", nixl_agent_config(backends=[]))
    yield agent


def isolate_aws_chain(monkeypatch, env: dict[str, str]) -> None:
    """This process's AWS credential chain (and its children's) finds only what ``env`` names: no keys, profile,
    config files or instance metadata of the machine's."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def same(a: dict, b: dict, tolerance: float = 0.0) -> bool:
    """Two greedy outputs (``tokens``, ``logprobs``) agree: equal tokens, logprobs within ``tolerance``."""
    if a["tokens"] != b["tokens"]:
        return False
    return max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0) <= tolerance


def resealed(stored: bytes, chunk_hash: str, num_layers: int, key: bytes | None = TEST_INTEGRITY_KEY) -> bytes:
    """A stored object's KV under a trailer that verifies as ``chunk_hash``'s in keyed mode under ``key`` (by
    default the test session's), or in checksum mode (``key`` None).

    What a writer holding the key can do (and, in checksum mode, anyone who
    can write to the store): the negative controls serve such a chunk to show
    that a comparison catches wrong KV. Use another chunk's real KV, not noise:
    random bytes hold NaN patterns, which the reader refuses on their own.
    """
    layout = BlockLayout(num_layers, len(stored) // num_layers - DIGEST_BYTES)
    assert layout.object_bytes == len(stored)
    sealed = np.frombuffer(bytearray(stored), dtype=np.uint8)
    ChunkIntegrity(layout, key).seal(chunk_hash, sealed)
    return sealed.tobytes()


def through_router(router, prompt: list[int], max_tokens: int) -> tuple[dict, dict[str, str]]:
    """A greedy completion through a ``dualpath_dev.engines.RouterProcess``: (output as a baseline has it,
    x-dualpath-* headers)."""
    answer, headers, _ = router.complete(
        {
            "model": router_model(router), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        }  # fmt: skip
    )
    choice = answer["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}, headers


def router_model(router) -> str:
    return json.loads(router.config_path.read_text())["served_model_names"][0]


@contextlib.contextmanager
def pd_pair(model: Path, store: S3Server, logs: Path, **options) -> Iterator[tuple]:
    """A PE and a DE (``dualpath_dev.engines.VLLMServer`` on configs/pe.json and de.json, ``options`` for
    both: ``keys`` is required) on ``store`` (SeaweedFS, or versitygw over TLS), started and warmed up side by
    side; stopped by the PIDs they hold, also on failure."""
    pe = VLLMServer(model, store, logs / "pe.log", config="pe.json", **options)
    de = VLLMServer(model, store, logs / "de.log", config="de.json", **options)
    try:
        start_all([pe, de])
        # The store serves objects of the pair's bucket before a session claims who read them: at the suite's
        # start a fresh SeaweedFS left every first GET of a new bucket unanswered for a minute (twice at TP=2,
        # cause unknown), and a turn's read lost that minute to its deadline. The probe's time is in the output.
        bucket = options.get("bucket", "dualpath-kv")
        print(f"bucket {bucket!r} served a probe object after {store.warm_bucket(bucket):.2f}s")
        # vLLM compiles its logprobs gather on first use, which stalls that
        # engine for seconds to a minute on 2 cores; do it before the DE serves
        # peers, in both engines at once.
        warm_up = {"model": str(model), "prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 0,
                   "return_tokens_as_token_ids": True}
        with ThreadPoolExecutor(2) as pool:
            for warmed in [pool.submit(server.post, "/v1/completions", warm_up, 900) for server in (pe, de)]:
                warmed.result()
        yield pe, de
    finally:
        pe.stop()
        de.stop()


class ThirdPartyProxy(ServiceProcess):
    """A P/D proxy in front of one PE and one DE on a free port, stopped by its PID; subclasses set ``args``."""

    stop_grace_s = 5.0

    def __init__(self, pe, log_path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.health_url = f"{self.url}/health"
        self._model, self._headers = str(pe.model), pe.keys.auth_headers()

    def complete(self, prompt: list[int], max_tokens: int, **fields) -> dict:
        """A greedy completion through the proxy, as a baseline has it (tokens and logprobs); ``fields`` join the
        body (a multi-turn proxy's ``conversation_id``)."""
        body = {"model": self._model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
                **fields}  # fmt: skip
        status, answer, _ = post(f"{self.url}/v1/completions", body, self._headers)
        assert status == 200, answer
        choice = answer["choices"][0]
        return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


class NixlStyleProxy(ThirdPartyProxy):
    """tests/nixl_style_proxy.py (vLLM's P/D proxy example's flow, nothing of ours imported)."""

    def __init__(self, pe, de, log_path, *extra: str) -> None:
        super().__init__(pe, log_path)
        self.args = [sys.executable, str(Path(__file__).with_name("nixl_style_proxy.py")), "--port", str(self.port),
                     "--prefill", pe.base_url, "--decode", de.base_url, *extra]  # fmt: skip


class LlmdSidecar(ThirdPartyProxy):
    """llm-d's P/D routing sidecar (third_party/llm-d-pd-sidecar, built by ``make setup``) as llm-d runs it: beside
    the DE, NixlConnector's protocol, the PE named per request in ``x-prefiller-host-port`` (llm-d's scheduler
    sets it), plain HTTP."""

    def __init__(self, pe, de, log_path) -> None:
        super().__init__(pe, log_path)
        binary = Path(sys.executable).with_name("pd-sidecar")
        if not binary.exists():
            raise FileNotFoundError(f"{binary}: `make setup` builds llm-d's sidecar (third_party/llm-d-pd-sidecar)")
        self.args = [str(binary), "--port", str(self.port), "--vllm-port", str(de.port), "--connector", "nixlv2",
                     "--secure-proxy=false"]  # fmt: skip
        self._headers = {**self._headers, "x-prefiller-host-port": f"127.0.0.1:{pe.port}"}
