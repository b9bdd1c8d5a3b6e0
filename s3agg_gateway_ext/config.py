"""The gateway's configuration: one dataclass, read from YAML and validated once.

The store behind the gateway is a ``store:`` section written exactly as for
the connector's ``s3`` store (:class:`nixl_backends.s3_endpoint.S3StoreConfig`),
or its ``posix`` store (:class:`nixl_backends.posix.PosixStoreConfig`: the
gateway runs next to the disks, reads the root's files and serves the root as
the one bucket named in ``buckets``).
String values of the form ``${NAME}``, also inside ``store``, are taken from
the environment, so secrets can stay out of the file. Secret fields never
appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from nixl_backends.configuration import ConfigError, from_dict
from nixl_backends.registry import parse_store_config
from nixl_backends.posix import PosixStoreConfig
from nixl_backends.s3_endpoint import S3StoreConfig

_ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
MIB = 1 << 20
GIB = 1 << 30

Policy = Literal["equal", "kv_prop", "bw_prop", "stall_opt", "calibrated_stall_opt"]

# Keys of an s3 store section the gateway sets itself, and why.
_GATEWAY_OWNED_STORE_KEYS = {
    "create_bucket": "the gateway never creates buckets",
    "io_threads": "the gateway's is the top-level io_threads",
    "io_timeout_s": "the gateway's is the top-level io_timeout_s",
    "io_retries": "the gateway reads each range once; a failed read fails the request, and the s3agg client, "
                  "on its own store.s3.io_retries, reads the chunks from the bucket",
}


@dataclass
class GatewayConfig:
    """Everything ``s3agg-gateway`` needs; see ``configs/gateway.yaml`` for a commented example."""

    # The store behind the gateway: an s3 store section ({backend: s3, endpoint,
    # bucket, region, addressing_style, access_key, secret_key, ca_bundle}), or a
    # posix one ({backend: posix, root, io_engine}); shown parsed, secret hidden,
    # as store_config.
    store: dict = field(repr=False)
    # The buckets served (NIXL's OBJ backend binds one bucket: an agent each);
    # s3: default the store section's bucket, which must be one of them;
    # posix: required, exactly one (the name clients give the root).
    buckets: list | None = None
    # The SigV4 identity clients sign extension requests with.
    client_access_key: str = ""
    client_secret_key: str = field(default="", repr=False)
    host: str = "127.0.0.1"
    port: int = 9100
    # TLS: the server's certificate chain and key (PEM), both or neither; clients then use https:// and trust
    # its CA (the s3agg store's gateway_ca_bundle, the s3 section's ca_bundle).
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    # A PUT whose body the signature does not cover (NIXL OBJ's STREAMING-UNSIGNED-PAYLOAD-TRAILER: the AWS C++
    # SDK signs headers only, with a checksum trailer) is refused unless allowed here, which needs TLS: over
    # plain HTTP anyone on the path could replace the body of a request they did not sign.
    allow_unsigned_payload: bool = False
    # A request body (descriptor, PUT object) above this gets 413 before it is read whole; read only after the
    # signed headers verified. Connections served at once (more get 503).
    max_body_bytes: int = 256 * MIB
    max_connections: int = 1024
    # A connection whose request head is not complete this long after its first byte was awaited is closed
    # (408); at max_connections, those make room for new ones (nixl_backends.http_head_timeout).
    head_timeout_s: float = 5.0
    # Mode selection: payloads W = N*L*S below theta are served chunkwise.
    theta_bytes: int = 512 * MIB
    # Descriptor limits: anything larger is refused before a byte is read.
    max_layers: int = 1024
    max_layer_chunk_bytes: int = 64 * MIB
    max_chunks: int = 1 << 17
    max_payload_bytes: int = 16 * GIB
    # Storage reads: NIXL OBJ threads, and the smallest ranged GET the engine
    # issues (consecutive layers of a chunk are read together up to this size;
    # 0 = exactly one layer per GET, the paper's schedule). A GET to an S3 store
    # costs milliseconds whatever its size: 4 MiB keeps it a few times its
    # latency at ~1 GB/s, and a window of every layer is one GET per object.
    io_threads: int = 16
    io_timeout_s: float = 60.0
    min_read_bytes: int = 4 * MIB
    # Staging memory (s3agg_gateway_ext.staging): a request needing more than max_request_staging_bytes is
    # refused (413; layerwise reads first use smaller windows to fit); all requests together stage at most
    # max_staging_bytes, a request waits staging_wait_s for room, then ends SlowDown (its client reads the
    # bucket). What abandoned transfers staged counts until NIXL ended them.
    max_request_staging_bytes: int = 2 * GIB
    max_staging_bytes: int = 8 * GIB
    staging_wait_s: float = 2.0
    # Bandwidth scheduling of layerwise deliveries (0 = no cap, no pacing).
    policy: Policy = "calibrated_stall_opt"
    bandwidth_cap_bytes_s: float = 0.0
    margin_bytes_s: float = 0.0
    epoch_s: float = 0.02
    quantum_bytes: int = 256 * 1024
    # Used for scheduling when a descriptor declares no per-layer compute window.
    default_compute_window_s: float = 0.01
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    store_config: S3StoreConfig | PosixStoreConfig = field(init=False)
    # "s3" or "posix", from store.backend (s3agg_gateway_ext.backing).
    backing: str = field(init=False)

    def validate(self) -> None:
        if not self.client_access_key or not self.client_secret_key:
            raise ConfigError("client_access_key and client_secret_key are required (SigV4 identity of clients)")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        positive = ("max_body_bytes", "max_connections", "head_timeout_s", "theta_bytes", "max_layers", "max_layer_chunk_bytes", "max_chunks", "max_payload_bytes",
                    "io_threads", "io_timeout_s", "epoch_s", "quantum_bytes", "default_compute_window_s",
                    "max_request_staging_bytes", "max_staging_bytes", "staging_wait_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("min_read_bytes", "bandwidth_cap_bytes_s", "margin_bytes_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ConfigError("tls_certfile and tls_keyfile must be given together")
        for name in ("tls_certfile", "tls_keyfile"):
            if getattr(self, name) is not None and not Path(getattr(self, name)).is_file():
                raise ConfigError(f"{name}: no such file {getattr(self, name)!r}")
        if self.allow_unsigned_payload and self.tls_certfile is None:
            raise ConfigError("allow_unsigned_payload needs TLS (tls_certfile and tls_keyfile): over plain HTTP a "
                              "body the signature does not cover can be replaced on the way")
        if self.max_request_staging_bytes > self.max_staging_bytes:
            raise ConfigError(f"max_request_staging_bytes ({self.max_request_staging_bytes}) must not exceed "
                              f"max_staging_bytes ({self.max_staging_bytes})")
        self.backing = self.store.get("backend")
        if self.backing == "posix":
            self.store_config = parse_store_config(self.store, "store.")
            if self.buckets is None or len(self.buckets) != 1:
                raise ConfigError(f"buckets must name exactly one bucket for a posix store (the name clients "
                                  f"give its root), got {self.buckets!r}")
        else:
            self.store_config = self._parse_s3_store()
            if self.buckets is None:
                self.buckets = [self.store_config.bucket]
        if not self.buckets or not all(isinstance(b, str) and 3 <= len(b) <= 63 for b in self.buckets):
            raise ConfigError(f"buckets must be a non-empty list of 3-63 character names, got {self.buckets!r}")
        if self.backing == "s3" and self.store_config.bucket not in self.buckets:
            raise ConfigError(f"store.bucket {self.store_config.bucket!r} must be one of buckets {self.buckets!r}")

    def _parse_s3_store(self) -> S3StoreConfig:
        if self.backing != "s3":
            raise ConfigError(f"store.backend must be 's3' or 'posix' for the gateway, got {self.backing!r}")
        for key, reason in _GATEWAY_OWNED_STORE_KEYS.items():
            if key in self.store:
                raise ConfigError(f"store.{key} is not accepted here: {reason}")
        gateway_owned = {"create_bucket": False, "io_threads": self.io_threads, "io_timeout_s": self.io_timeout_s,
                         "io_retries": 0}  # fmt: skip
        return parse_store_config({**self.store, **gateway_owned}, "store.")

    def bucket_config(self, bucket: str) -> S3StoreConfig:
        """The store section for one served bucket (one NIXL agent and OBJ backend each)."""
        return dataclasses.replace(self.store_config, bucket=bucket)


def _expand_env(value: Any, where: str) -> Any:
    """``${NAME}`` strings replaced by the environment's value, in nested sections too."""
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, str):
        match = _ENV_REF.match(value)
        if match:
            if match.group(1) not in os.environ:
                raise ConfigError(f"{where}: environment variable {match.group(1)} is not set")
            return os.environ[match.group(1)]
    return value


def parse_config(data: dict[str, Any]) -> GatewayConfig:
    """Validate a plain dict (already parsed YAML) into :class:`GatewayConfig`."""
    if not isinstance(data, dict):
        raise ConfigError(f"gateway config must be a mapping, got {type(data).__name__}")
    return from_dict(GatewayConfig, {k: _expand_env(v, k) for k, v in data.items()}, "")


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and validate a YAML config file."""
    return parse_config(yaml.safe_load(Path(path).read_text()) or {})
