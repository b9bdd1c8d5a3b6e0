"""The gateway as a child process on a free port, for tests and benchmarks.

It runs exactly as in production (``python -m s3agg_gateway_ext.app --config``),
in its own process group, and is stopped by the PID it holds.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from dualpath_connector.devstack import free_port, stop_process_group


class GatewayProcess:
    """``s3agg-gateway`` with the given config (``host``/``port`` are chosen here)."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.config = dict(config)
        self.workdir = Path(workdir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"gateway-{self.port}.log"

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config_path = self.workdir / f"gateway-{self.port}.yaml"
        config_path.write_text(yaml.safe_dump({**self.config, "host": "127.0.0.1", "port": self.port}))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "s3agg_gateway_ext.app", "--config", str(config_path)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited early; see {self.log_path}:\n{self.log_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass  # not listening yet
            time.sleep(0.05)
        raise TimeoutError(f"gateway not healthy after {timeout_s}s; see {self.log_path}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process_group(self.proc, grace_s=5.0)
        self.proc = None

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
