"""vLLM engines with DualPathConnector and the router in front of them, as child processes."""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nixl_backends.integrity import INTEGRITY_KEY_ENV, derived_integrity_key
from nixl_backends.lookup import wait_stored

from dualpath_connector.pd.cluster_auth import CLUSTER_KEY_ENV
from dualpath_connector.protocol import StoreKeySpace, metric_total

from dualpath_dev.processes import ServiceProcess, forward_threads_env, free_port
from dualpath_dev.seaweedfs import SeaweedFS

# The ready-made configs of the checkout (this package exists only in a checkout).
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Where the routers started here read the engines' API key (named in their config as engine_api_key_env).
ROUTER_KEY_ENV = "DUALPATH_ENGINE_API_KEY"
# KV cache per worker: 256k tokens of the tiny model (2 KiB a token), 32 times its longest context. The CPU
# build touches every byte of it at start-up; at vLLM's usual 2 GiB a worker, the seven workers a full
# `make test` can run at once (two modules side by side, TP=2 pairs) did not fit 24 GiB: the kernel killed
# a worker mid start-up (its engine then never answered /health) and vLLM refused the next engine's KV cache.
TEST_KV_CACHE_BYTES = 512 * 1024 * 1024


_PROCESS_KEYS: ClusterKeys | None = None


@dataclass(frozen=True)
class ClusterKeys:
    """One cluster's secrets, random per run: every engine of the cluster and its router share them.

    ``api_key``: what the engines' OpenAI servers demand (vLLM reads
    ``VLLM_API_KEY``; the environment keeps it out of ``ps``), sent by the
    router and by the helpers here. ``cluster_key``: what authenticates
    PE<->DE side-channel messages. ``integrity_secret``: what keys the MAC on
    every stored Layer Block (``integrity: "keyed"``, as configs/ run): a
    writer of the bucket without it cannot make a chunk the engines load.
    """

    api_key: str = field(repr=False)
    cluster_key: str = field(repr=False)
    integrity_secret: str = field(repr=False)

    @classmethod
    def generate(cls) -> ClusterKeys:
        return cls(secrets.token_hex(16), secrets.token_hex(32), secrets.token_hex(32))

    @classmethod
    def of_this_process(cls) -> ClusterKeys:
        """One set per process, generated on first use: the engines a test or bench starts without keys of their
        own are one deployment, sharing stored chunks (their namespace holds the integrity key's fingerprint)."""
        global _PROCESS_KEYS
        if _PROCESS_KEYS is None:
            _PROCESS_KEYS = cls.generate()
        return _PROCESS_KEYS

    def engine_env(self) -> dict[str, str]:
        return {"VLLM_API_KEY": self.api_key, CLUSTER_KEY_ENV: self.cluster_key,
                INTEGRITY_KEY_ENV: self.integrity_secret}  # fmt: skip

    def integrity_key(self) -> bytes:
        """The MAC key the engines derive from ``integrity_secret`` (to forge a chunk as a keyholder would)."""
        return derived_integrity_key(self.integrity_secret)

    def router_env(self) -> dict[str, str]:
        # The cluster key lets the router end a PE's hold when no DE will pull it.
        return {ROUTER_KEY_ENV: self.api_key, CLUSTER_KEY_ENV: self.cluster_key}

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


class VLLMServer(ServiceProcess):
    """vLLM's OpenAI server (CPU build, tiny Llama) with DualPathConnector on an S3 server.

    ``config`` names a file in ``configs/`` (``single.json``, ``pe.json``,
    ``de.json``); the store endpoint, the side-channel port (a free one) and
    ``extra`` keys of ``kv_connector_extra_config`` are filled in here.
    Credentials travel in the standard AWS variables, never on the command
    line, where vLLM would log them with its arguments. vLLM's local prefix
    cache is off, so every hit it reports was read from the store.
    ``host``: the address it listens on and is reached at; ``launcher``: a
    command prefix (``ip netns exec <ns>`` for a network namespace).
    ``keys``: the cluster's secrets (:class:`ClusterKeys`), in the environment
    too; the PE and DE of one cluster need the same, a single-instance engine
    (``kv_both``) takes the process's own when none is given (:meth:`ClusterKeys.of_this_process`). ``tensor_parallel_size``:
    its TP workers get this machine's cores split among them, and a PD engine
    free side-channel ports for every rank (``side_channel_port`` + rank). ``kv_cache_bytes``: each worker's
    KV cache (``--kv-cache-memory-bytes``). ``pin_forwards``: its forward threads pinned to all cores but the
    last (:func:`forward_threads_env`), as a benchmark wants them; otherwise the kernel places them.
    ``store_options``: keys of the store section (``io_timeout_s``, ...) over the config's.
    """

    def __init__(
        self,
        model: Path,
        s3: SeaweedFS,
        log_path: Path,
        max_model_len: int = 8192,
        config: str = "single.json",
        extra: dict | None = None,
        max_num_batched_tokens: int | None = None,
        bucket: str | None = None,
        *,
        host: str = "127.0.0.1",
        launcher: Sequence[str] = (),
        keys: ClusterKeys | None = None,
        vllm_args: Sequence[str] = (),
        tensor_parallel_size: int = 1,
        kv_cache_bytes: int = TEST_KV_CACHE_BYTES,
        pin_forwards: bool = False,
        store_options: dict | None = None,
    ) -> None:
        self.kv_config = json.loads((CONFIGS / config).read_text())
        extra_config = self.kv_config["kv_connector_extra_config"]
        extra_config["store"]["endpoint"] = s3.endpoint
        # A server speaking TLS with its own CA (versitygw); a stand-in without the attribute speaks plain HTTP.
        if getattr(s3, "ca_bundle", None):
            extra_config["store"]["ca_bundle"] = s3.ca_bundle
        if bucket is not None:
            extra_config["store"]["bucket"] = bucket
        extra_config["store"].update(store_options or {})
        extra_config.update(extra or {})
        self.side_channel = None
        if self.kv_config["kv_role"] != "kv_both":
            if keys is None:
                raise ValueError(f"{config}: the engines of a PD cluster share one ClusterKeys; pass keys=")
            # Rank r serves at side_channel_port + r.
            extra_config["side_channel_port"] = free_port(tensor_parallel_size)
            self.side_channel = f"{extra_config['side_channel_host']}:{extra_config['side_channel_port']}"
        self.keys = keys if keys is not None else ClusterKeys.of_this_process()
        self.model = model
        self._s3 = s3
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://{host}:{self.port}"
        self.env = dict(
            os.environ,
            AWS_ACCESS_KEY_ID=s3.access_key,
            AWS_SECRET_ACCESS_KEY=s3.secret_key,
            VLLM_CPU_NUM_OF_RESERVED_CPU="1",
            PYTHONUNBUFFERED="1",
            **self.keys.engine_env(),
        )
        # The size comes from --kv-cache-memory-bytes; vLLM's legacy variable (whole GiB) would override it.
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        # The forward's thread count of tests/vllm_engine.py's engines, whose outputs these must equal bit for bit.
        self.env.update(forward_threads_env(tensor_parallel_size, pinned=pin_forwards))
        # The engine loads the model directory's tokenizer, as `vllm serve MODEL` does in production:
        # token-id prompts and `return_token_ids` answer as without one (the router asks for token ids
        # and writes the client's text itself), and vLLM checks prompt ids against it too.
        self.args = [
            *launcher, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--dtype", "bfloat16",
            "--block-size", "32", "--enforce-eager", "--seed", "0",
            "--host", host, "--port", str(self.port),
            "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(self.kv_config),
            # vLLM's --api-key leaves /invocations open; the guard closes every path but the probes.
            "--middleware", "dualpath_connector.EngineKeyGuard",
        ]  # fmt: skip
        if max_num_batched_tokens is not None:
            self.args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        if tensor_parallel_size > 1:
            self.args += ["--tensor-parallel-size", str(tensor_parallel_size)]
        # Last: vLLM takes the last of a repeated flag (--enable-prefix-caching overrides the default above).
        self.args += vllm_args
        self.health_url = f"{self.base_url}/health"

    @property
    def s3(self) -> SeaweedFS:
        """The S3 server whose keys the engine has (its store endpoint may be a relay in front of it)."""
        return self._s3

    def _request(self, path: str, body: dict) -> urllib.request.Request:
        """A POST to the server carrying the cluster's API key (without it the /v1 paths answer 401)."""
        headers = {"Content-Type": "application/json", **self.keys.auth_headers()}
        return urllib.request.Request(f"{self.base_url}{path}", data=json.dumps(body).encode(), headers=headers)

    def post(self, path: str, body: dict, timeout_s: float = 600.0) -> dict:
        """A POST with the API key; the JSON answer."""
        with urllib.request.urlopen(self._request(path, body), timeout=timeout_s) as response:
            return json.loads(response.read())

    def complete(self, prompt: list[int], max_tokens: int, timeout_s: float = 600.0) -> tuple[float, list[int], dict]:
        """A greedy streaming completion: (seconds to first token, token ids, usage)."""
        body = {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        started = time.perf_counter()
        first_token_s = None
        tokens: list[int] = []
        usage: dict = {}
        with urllib.request.urlopen(self._request("/v1/completions", body), timeout=timeout_s) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and first_token_s is None:
                        first_token_s = time.perf_counter() - started
                    tokens.extend(ids)
                usage = event.get("usage") or usage
        if first_token_s is None:
            raise RuntimeError("the stream carried no token ids")
        return first_token_s, tokens, usage

    def wait_stored(self, tokens: list[int], timeout_s: float = 120.0) -> None:
        """Wait until every shard of every full chunk of ``tokens`` is in the store (saves are asynchronous)."""
        key_space = self.key_space()  # a TP engine's: every rank's shard of each chunk
        store = self._s3.lookup_store(self.kv_config["kv_connector_extra_config"]["store"], key_space.layout)
        try:
            wait_stored(store, key_space.chunk_keys(tokens), timeout_s)
        finally:
            store.close()

    def key_space(self) -> StoreKeySpace:
        """What names this engine's stored chunks, from its /metrics."""
        return StoreKeySpace.from_metrics(self.metrics_text())

    def metric_total(self, name: str) -> float:
        """Sum of a Prometheus series over its labels on the server's /metrics."""
        return metric_total(self.metrics_text(), name)

    def metrics_text(self) -> str:
        """The server's /metrics (Prometheus text)."""
        # Generous: a suite run once found an engine's /metrics unanswered for 30 s on the loaded 2-core host.
        return urllib.request.urlopen(f"{self.base_url}/metrics", timeout=90).read().decode()


class RouterProcess(ServiceProcess):
    """``dualpath-router`` in its own process on a free port, in front of PD engines.

    The store section is the PE's (credentials travel in the AWS variables,
    the engines' API key in ``DUALPATH_ENGINE_API_KEY``); the served model's
    directory gives the vocabulary size (its config.json) and the tokenizer
    for text prompts and chat; ``overrides`` are top-level router config keys
    (``policy``, ``read_side``...).
    """

    def __init__(
        self, prefill: list[VLLMServer], decode: list[VLLMServer], s3: SeaweedFS, workdir: Path, **overrides: object
    ) -> None:
        keys = prefill[0].keys
        if any(engine.keys != keys for engine in (*prefill, *decode)):
            raise ValueError("the router's engines must be one cluster: they share one ClusterKeys")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        store = prefill[0].kv_config["kv_connector_extra_config"]["store"]
        config = {
            "host": "127.0.0.1",
            "port": self.port,
            "served_model_names": [str(prefill[0].model)],
            "model_config": str(Path(prefill[0].model).resolve()),
            "tokenizer": str(Path(prefill[0].model).resolve()),
            "engine_api_key_env": ROUTER_KEY_ENV,
            "policy": "dualpath",
            # The dev stack's tests, demos and benches read each answer's hit.
            "report_hit_tokens": True,
            "prefill_engines": [
                {"name": f"pe{i}", "url": pe.base_url, "node": f"node-pe{i}"} for i, pe in enumerate(prefill)
            ],
            "decode_engines": [
                {"name": f"de{i}", "url": de.base_url, "node": f"node-de{i}", "side_channel": de.side_channel}
                for i, de in enumerate(decode)
            ],
            "store": store,
            "namespace": "auto",
            **overrides,
        }
        self.config_path = workdir / f"router-{self.port}.yaml"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML
        self.log_path = workdir / f"router-{self.port}.log"
        self.env = dict(os.environ, AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key,
                        **keys.router_env())
        self.args = [sys.executable, "-m", "dualpath_router.app", "--config", str(self.config_path)]
        # /health is 200 once the router itself sees a healthy PE and DE.
        self.health_url = f"{self.url}/health"
        self.stop_grace_s = 10.0

    def complete(self, body: dict, timeout_s: float = 600.0) -> tuple[dict, dict[str, str], float]:
        """A non-streaming completion: (answer, x-dualpath-* headers, seconds)."""
        request = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            headers = {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-dualpath")}
            answer = json.loads(response.read())
        return answer, headers, time.perf_counter() - started


def cached_tokens(usage: dict) -> int:
    """Prompt tokens vLLM did not compute (``--enable-prompt-tokens-details``)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
