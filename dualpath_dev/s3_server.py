"""What the harness needs of any S3 server it starts: its endpoint, keys and CA, a boto3 client, a ``store``
section as a user would write it, and a start that waits until objects can be written and read back."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from nixl_backends.layout import BlockLayout
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.store import KVStore

from dualpath_dev.processes import stop_process_group

logger = logging.getLogger(__name__)

S3_ACCESS_KEY = "dualpath-dev"
S3_SECRET_KEY = "dualpath-dev-secret"


class S3Server:
    """A local S3 server process on ``host``; subclasses say how to start it (:meth:`start`)."""

    name = "S3 server"

    def __init__(self, data_dir: str | os.PathLike[str] | None, host: str) -> None:
        self.host = host
        self._owned_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="dualpath-s3-"))
        self.access_key = S3_ACCESS_KEY
        self.secret_key = S3_SECRET_KEY
        # The CA clients must trust (store.ca_bundle) when the server speaks TLS; None over plain HTTP.
        self.ca_bundle: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.s3_port = 0

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.ca_bundle else 'http'}://{self.host}:{self.s3_port}"

    def bucket_section(self, bucket: str) -> dict[str, object]:
        """A ``store`` section for ``bucket`` without keys (an engine takes them from the AWS variables), with
        this server's CA where it speaks TLS."""
        section: dict[str, object] = {"backend": "s3", "endpoint": self.endpoint, "bucket": bucket}
        if self.ca_bundle:
            section["ca_bundle"] = self.ca_bundle
        return section

    def store_config(self, bucket: str) -> dict[str, object]:
        """A ``store`` section for this server, as a user would write it: :meth:`bucket_section` and the keys."""
        return {**self.bucket_section(bucket), "access_key": self.access_key, "secret_key": self.secret_key}

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
        return make_store(parse_store_config({**section, **self.store_config(section["bucket"])}), layout)

    def client(self, max_attempts: int = 3, read_timeout_s: float = 60.0):
        """A boto3 S3 client for this server (path-style, its credentials, its CA)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            verify=self.ca_bundle,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": max_attempts},
                          read_timeout=read_timeout_s),
        )

    def warm_bucket(self, bucket: str, timeout_s: float = 300.0) -> float:
        """PUT, GET back and DELETE a probe object in ``bucket`` (created if missing); the seconds it took.

        What a test awaits before its first timed read of a fresh bucket: the bucket's volume exists and the
        server can serve objects from it (a new SeaweedFS volume is looked up on its first GET). A server
        that stalls first GETs under load then stalls this probe instead of a claim the test makes.
        """
        from botocore.exceptions import ClientError

        client = self.client(read_timeout_s=timeout_s)
        started = time.monotonic()
        try:
            client.create_bucket(Bucket=bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        key = f"warm-up-probe-{uuid.uuid4().hex}"
        client.put_object(Bucket=bucket, Key=key, Body=b"probe")
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"probe"
        client.delete_object(Bucket=bucket, Key=key)
        return time.monotonic() - started

    def start(self, timeout_s: float = 60.0) -> S3Server:
        raise NotImplementedError

    def _launch(self, args: Sequence[str], log_name: str, timeout_s: float, env: Mapping[str, str] | None = None) -> None:
        """Start ``args`` in its own process group, logging to ``data_dir/log_name``; return once it serves."""
        log = open(self.data_dir / log_name, "wb")
        self.proc = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=None if env is None else {**os.environ, **env})  # fmt: skip
        log.close()
        try:
            self._wait_ready(timeout_s, self.data_dir / log_name)
        except BaseException:
            self.stop()
            raise
        logger.info("%s S3 on %s (pid %d)", self.name, self.endpoint, self.proc.pid)

    def _wait_ready(self, timeout_s: float, log: Path) -> None:
        client = self.client(max_attempts=1)
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        # Ready means an object can be written and read back, not merely that the port answers (SeaweedFS's
        # volume servers register a few seconds after its S3 port opens).
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; see {log}")
            try:
                if "dualpath-ready" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
                    client.create_bucket(Bucket="dualpath-ready")
                client.put_object(Bucket="dualpath-ready", Key="probe", Body=b"ok")
                if client.get_object(Bucket="dualpath-ready", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # not up yet: connection refused, 5xx...
                last_error = exc
            time.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout_s}s: {last_error}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process_group(self.proc, grace_s=3.0)
        self.proc = None
        if self._owned_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
