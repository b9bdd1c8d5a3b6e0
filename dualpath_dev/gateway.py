"""The gateway as a child process on a free port, for tests and benchmarks.

It runs exactly as in production (``python -m s3agg_gateway_ext.app --config``),
in its own process group, ready once ``/healthz`` answers, and is stopped by
the PID it holds (:class:`dualpath_dev.processes.ServiceProcess`).
:func:`gateway_config` is the config the tests and the benchmark give it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from dualpath_dev.processes import ServiceProcess, free_port
from dualpath_dev.s3_server import S3Server
from dualpath_dev.tls import make_server_tls


def gateway_config(server: S3Server, bucket: str, client_access_key: str, client_secret_key: str,
                   **settings: Any) -> dict[str, Any]:
    """A gateway config serving ``bucket`` of ``server``; ``settings`` are further top-level keys."""
    return {
        # The store section a connector would use for this bucket (with the server's CA where it speaks TLS).
        "store": server.store_config(bucket),
        "client_access_key": client_access_key,
        "client_secret_key": client_secret_key,
        **settings,
    }


class GatewayProcess(ServiceProcess):
    """``s3agg-gateway`` with the given config; ``host``/``port`` are chosen here.

    ``tls``: serve https with a certificate of a CA made for this gateway (``ca_bundle``: the file clients
    trust); its config's ``tls_certfile``/``tls_keyfile`` are set here.
    """

    stop_grace_s = 5.0

    def __init__(self, config: dict[str, Any], workdir: Path, tls: bool = False) -> None:
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.ca_bundle: str | None = None
        if tls:
            certs = make_server_tls(workdir / f"tls-{self.port}", ["127.0.0.1", "localhost"], "s3agg-gateway test CA")
            config = {**config, "tls_certfile": str(certs.cert_file), "tls_keyfile": str(certs.key_file)}
            self.ca_bundle = self.health_ca = str(certs.ca_file)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        config_path = workdir / f"gateway-{self.port}.yaml"
        config_path.write_text(yaml.safe_dump({**config, "host": "127.0.0.1", "port": self.port}))
        self.args = [sys.executable, "-m", "s3agg_gateway_ext.app", "--config", str(config_path)]
        self.log_path = workdir / f"gateway-{self.port}.log"
        self.health_url = f"{self.url}/healthz"

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        return super().start(timeout_s)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
