"""A second, independent S3 server for development: Versity's versitygw over TLS, with a CA made per run.

versitygw (Apache-2.0, github.com/versity/versitygw) is an S3 server that
stores objects as files on a POSIX file system, as NAS-backed deployments
run it; ``make setup`` builds it from the Go module proxy into ``.venv/bin``.
It differs from SeaweedFS where clients feel it (ETags, error bodies, listing,
``aws-chunked`` uploads), which is why the store tests run against both.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from dualpath_dev.processes import free_port
from dualpath_dev.s3_server import S3Server
from dualpath_dev.tls import ServerTLS, make_server_tls

# What `make setup` installs (Makefile: VERSITYGW_VERSION).
VERSITYGW_MODULE = "github.com/versity/versitygw/cmd/versitygw"


def versitygw_binary() -> str:
    """The ``versitygw`` beside this interpreter (``make setup`` puts it there), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "versitygw")
    found = beside if os.path.exists(beside) else shutil.which("versitygw")
    if found is None:
        raise FileNotFoundError(f"versitygw not found: `make setup` builds it (go install {VERSITYGW_MODULE}@<version>)")
    return found


class VersityGW(S3Server):
    """versitygw's POSIX backend under ``data_dir``, serving S3 over TLS on 127.0.0.1 (``ca_bundle``: its CA)."""

    name = "versitygw"

    def __init__(self, data_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(data_dir, "127.0.0.1")
        self.tls: ServerTLS | None = None

    def start(self, timeout_s: float = 60.0) -> VersityGW:
        self.root.mkdir(parents=True, exist_ok=True)
        self.tls = make_server_tls(self.data_dir / "tls", [self.host, "localhost"])
        self.ca_bundle = str(self.tls.ca_file)
        self.s3_port = free_port()
        # Every request's time and status in access.log. Not --keep-alive: with it, one suite run had a boto3
        # PutObject on a kept connection refused "BadRequest: ... parsing the HTTP request" (at 26521b5).
        args = [versitygw_binary(), "--port", f"{self.host}:{self.s3_port}", "--cert", str(self.tls.cert_file),
                "--key", str(self.tls.key_file), "--quiet", "--access-log", str(self.access_log),
                "posix", str(self.root)]  # fmt: skip
        # The root keys through the environment, not the command line other users can read.
        self._launch(args, "versitygw.log", timeout_s,
                     env={"ROOT_ACCESS_KEY_ID": self.access_key, "ROOT_SECRET_ACCESS_KEY": self.secret_key})
        return self

    @property
    def access_log(self) -> Path:
        """One line per request: its time, operation, key, status and milliseconds taken."""
        return self.data_dir / "access.log"

    @property
    def root(self) -> Path:
        """Where the buckets' objects lie, one directory per bucket."""
        return self.data_dir / "buckets"
