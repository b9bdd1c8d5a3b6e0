"""An S3-compatible endpoint as this project reaches it: the ``s3`` section and the boto3 control path.

The ``s3`` store, the ``s3agg`` client (its ``s3`` sub-section) and
``s3agg-gateway`` (its ``store`` section) read the same section and reach the
bucket through the same boto3 client: HEADs and bucket management. Payload
bytes never go through boto3; they move through NIXL's OBJ plugin
(:mod:`nixl_backends.obj_backend`). The secret key is never logged or shown in
a repr.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError, SSLError

from nixl_backends.configuration import ConfigError

_NOT_FOUND = ("404", "NoSuchKey", "NotFound")
# DeleteObjects takes at most 1000 keys per request.
_DELETE_BATCH = 1000
# Credentials refused, as ensure_bucket's HEAD reports it: a HEAD response has no body to name
# the error (InvalidAccessKeyId, SignatureDoesNotMatch, ...), so botocore gives the bare status.
_REFUSED = ("401", "403")


@dataclass
class S3StoreConfig:
    """``{"backend": "s3", ...}``."""

    # Where the chunks live relative to the engine (vLLM KV events' locality): a bucket across the network.
    locality: ClassVar[str] = "REMOTE"

    bucket: str
    endpoint: str | None = None
    region: str = "us-east-1"
    addressing_style: Literal["path", "virtual"] = "path"
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    ca_bundle: str | None = None
    create_bucket: bool = True
    # NIXL OBJ worker threads: the most requests in flight per read or write. How many are in flight follows the
    # link's measured bandwidth-delay product (nixl_backends/window.py), from io_window_min (what runs before
    # anything is measured, and the least) up to io_threads.
    io_threads: int = 32
    io_window_min: int = 8
    io_timeout_s: float = 30.0
    # Requests of one read or write that failed (a dropped connection, a 5xx the SDK gave up on) are sent again
    # this many times before their chunk counts as failed: one lost GET would otherwise cost a hit its tail.
    # NIXL OBJ fails every GET the store throttled (503 SlowDown), even where the SDK's own retry then got the
    # object (tests/integration/test_stores.py), so a throttling store needs these.
    io_retries: int = 3
    # Before sending failed requests again: a pause drawn uniformly from [0, min(cap, base * 2^(n-1))] before the
    # n-th resend ("full jitter": clients a throttling store pushed back do not all come back at once).
    io_retry_base_s: float = 0.05
    io_retry_cap_s: float = 1.0
    # The AWS SDK's own CRC checksums on the payload requests (botocore's names and values): "when_supported"
    # computes one for every PUT and checks one on every GET; "when_required" only where an operation demands
    # it. Every object carries our integrity trailer, checked before any byte is used, so GETs skip the SDK's
    # (lmcache_l2-checksums.json: loads 1.3x at 2 and 8 MiB objects). A PUT's body is covered either way: NIXL
    # OBJ's SDK signs it with its SHA-256 (when_required), or, over https only, sends it unsigned with a CRC64
    # trailer (when_supported), which costs the client and the server less CPU than the SHA-256
    # (lmcache_l2-tls-checksums.json). Unset (None): when_supported over https, when_required over http, where
    # the SDK signs the body anyway (:attr:`request_checksum`).
    request_checksum_calculation: Literal["when_supported", "when_required"] | None = None
    response_checksum_validation: Literal["when_supported", "when_required"] = "when_required"

    @property
    def request_checksum(self) -> str:
        """``request_checksum_calculation`` as NIXL OBJ's SDK gets it: the configured value, else by the scheme."""
        if self.request_checksum_calculation is not None:
            return self.request_checksum_calculation
        return "when_required" if (self.endpoint or "").startswith("http://") else "when_supported"

    def validate(self) -> None:
        if not 3 <= len(self.bucket) <= 63:
            raise ConfigError(f"store.bucket must be 3 to 63 characters, got {self.bucket!r}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ConfigError("store.access_key and store.secret_key must be given together")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"store.endpoint must start with http:// or https://, got {self.endpoint!r}")
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise ConfigError(f"store.ca_bundle: no such file {self.ca_bundle!r}")
        if self.io_threads <= 0 or self.io_window_min <= 0 or self.io_timeout_s <= 0:
            raise ConfigError("store.io_threads, store.io_window_min and store.io_timeout_s must be positive")
        if isinstance(self.io_retries, bool) or not isinstance(self.io_retries, int) or self.io_retries < 0:
            raise ConfigError(f"store.io_retries must be a whole number >= 0, got {self.io_retries!r}")
        if not 0 <= self.io_retry_base_s <= self.io_retry_cap_s <= 60:
            raise ConfigError("store.io_retry_base_s and store.io_retry_cap_s must satisfy 0 <= base <= cap <= 60 "
                              f"(seconds), got {self.io_retry_base_s} and {self.io_retry_cap_s}")
        # request_checksum_calculation may also be left unset (chosen by the endpoint's scheme).
        for name, value in (("request_checksum_calculation", self.request_checksum),
                            ("response_checksum_validation", self.response_checksum_validation)):  # fmt: skip
            if value not in ("when_supported", "when_required"):
                raise ConfigError(f"store.{name} must be when_supported or when_required, got {value!r}")


class UntrustedServer(ConfigError):
    """The S3 endpoint's TLS certificate does not verify against ``store.ca_bundle`` (or the system's CAs)."""


def s3_session(config: S3StoreConfig) -> boto3.session.Session:
    """The session of the configured keys, or of the standard AWS credential chain without them."""
    return boto3.session.Session(
        aws_access_key_id=config.access_key,
        aws_secret_access_key=config.secret_key,
        region_name=config.region,
    )


def s3_client(config: S3StoreConfig, session: boto3.session.Session, max_pool_connections: int) -> Any:
    """A boto3 S3 client for the configured endpoint; ``max_pool_connections`` bounds concurrent calls."""
    return session.client(
        "s3",
        endpoint_url=config.endpoint,
        verify=config.ca_bundle if config.ca_bundle else None,
        config=BotoConfig(
            s3={"addressing_style": config.addressing_style},
            max_pool_connections=max_pool_connections,
            retries={"max_attempts": 2},
            # Lookups run on vLLM's scheduler thread and the gateway's checks
            # before every request: a hung endpoint must cost seconds, not minutes.
            connect_timeout=2,
            read_timeout=5,
        ),
    )


def _error_code(exc: ClientError) -> str:
    response = exc.response
    return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


def ensure_bucket(client: Any, bucket: str, create: bool = True) -> None:
    """Check at start-up that the store accepts these credentials; create the bucket if missing and ``create``.

    Any failure is a :class:`ConfigError` naming the endpoint and the bucket,
    so wrong credentials stop an engine at start-up instead of turning every
    request into a silent miss. The message never carries the secret key
    (boto3's errors do not either; they are not chained, so no traceback shows
    more than the message).
    """
    where = f"S3 store {client.meta.endpoint_url}, bucket {bucket!r}"
    try:
        client.head_bucket(Bucket=bucket)
        return
    except ClientError as exc:
        code = _error_code(exc)
        if code in _REFUSED:
            raise ConfigError(
                f"{where}: the store refused the credentials ({code}); check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or store.access_key/store.secret_key) and that they may use this bucket"
            ) from None
        if code not in _NOT_FOUND:
            raise ConfigError(f"{where}: checking the bucket failed ({code})") from None
    except SSLError as exc:
        raise UntrustedServer(f"{where}: the server's TLS certificate is not trusted ({exc}); set store.ca_bundle "
                              "to the file of the CA that signed it") from None
    except BotoCoreError as exc:  # unreachable endpoint, no credentials at all
        raise ConfigError(f"{where}: {exc}") from None
    if not create:
        return  # a lookup-only client may come before the bucket's first writer
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        code = _error_code(exc)
        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):  # another client created it meanwhile
            raise ConfigError(f"{where}: no such bucket, and creating it failed ({code})") from None


def object_size(client: Any, bucket: str, key: str) -> int | None:
    """The object's size from a HEAD, or None if it does not exist; other failures raise."""
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in _NOT_FOUND:
            return None
        raise
    return head["ContentLength"]


def delete_objects(client: Any, bucket: str, keys: Sequence[str]) -> dict[str, str]:
    """Delete ``keys`` with DeleteObjects (absent keys count as deleted); the refused ones, key -> error code."""
    refused: dict[str, str] = {}
    for start in range(0, len(keys), _DELETE_BATCH):
        batch = [{"Key": key} for key in keys[start : start + _DELETE_BATCH]]
        response = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        refused.update({error["Key"]: error.get("Code", "?") for error in response.get("Errors", ())})
    return refused
