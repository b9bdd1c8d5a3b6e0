"""S3 backend: Full Blocks as objects, data through NIXL's OBJ plugin, control through boto3.

Works with any S3-compatible endpoint (SeaweedFS, MinIO, Ceph RGW, AWS S3).
Addressing is path-style by default (what on-prem stores expect) or
virtual-hosted. Credentials come from the config or the standard AWS chain;
the secret key is never logged or shown in a repr.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError

from nixl_backends.configuration import ConfigError
from nixl_backends.layout import BlockLayout
from nixl_backends.store import KVStore, StoreCapabilities, descriptors, run_nixl_transfers

logger = logging.getLogger(__name__)

_LOOKUP_WINDOW = 16  # HEADs in flight at once during a leading-run lookup


@dataclass
class S3StoreConfig:
    """``{"backend": "s3", ...}``."""

    bucket: str
    endpoint: str | None = None
    region: str = "us-east-1"
    addressing_style: Literal["path", "virtual"] = "path"
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    ca_bundle: str | None = None
    create_bucket: bool = True
    io_threads: int = 8
    io_timeout_s: float = 30.0

    def validate(self) -> None:
        if not 3 <= len(self.bucket) <= 63:
            raise ConfigError(f"store.bucket must be 3 to 63 characters, got {self.bucket!r}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ConfigError("store.access_key and store.secret_key must be given together")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"store.endpoint must start with http:// or https://, got {self.endpoint!r}")
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise ConfigError(f"store.ca_bundle: no such file {self.ca_bundle!r}")
        if self.io_threads <= 0 or self.io_timeout_s <= 0:
            raise ConfigError("store.io_threads and store.io_timeout_s must be positive")


_cuobj_lock = threading.Lock()
_cuobj_ready = False


def ensure_obj_plugin_loadable() -> None:
    """Make NIXL's OBJ plugin loadable where NVIDIA's cuObject client is not installed.

    The plugin links libcuobjclient.so.1 for an optional RDMA path. When the
    real library is absent we load our stand-in (same SONAME, always "not
    connected") into the global scope, so the plugin uses plain S3.
    """
    global _cuobj_ready
    with _cuobj_lock:
        if _cuobj_ready:
            return
        try:
            ctypes.CDLL("libcuobjclient.so.1", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            found = glob.glob(os.path.join(os.path.dirname(__file__), "_cuobj_compat*.so"))
            if not found:
                raise RuntimeError(
                    "NIXL's OBJ plugin needs libcuobjclient.so.1 and the bundled stand-in "
                    "was not built; reinstall dualpath-kv with a C++ compiler available"
                ) from None
            ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
            logger.debug("loaded cuObject stand-in %s for NIXL OBJ", found[0])
        _cuobj_ready = True


class S3Store(KVStore):
    capabilities = StoreCapabilities(ranged_reads=True, shared_across_nodes=True)

    def __init__(self, config: S3StoreConfig, layout: BlockLayout, agent=None) -> None:
        super().__init__(layout)
        self.config = config
        session = boto3.session.Session(
            aws_access_key_id=config.access_key,
            aws_secret_access_key=config.secret_key,
            region_name=config.region,
        )
        self._client = session.client(
            "s3",
            endpoint_url=config.endpoint,
            verify=config.ca_bundle if config.ca_bundle else None,
            config=BotoConfig(
                s3={"addressing_style": config.addressing_style},
                max_pool_connections=_LOOKUP_WINDOW,
                retries={"max_attempts": 2},
                # Lookups run on vLLM's scheduler thread: a hung endpoint must
                # cost seconds, not minutes.
                connect_timeout=2,
                read_timeout=5,
            ),
        )
        if config.create_bucket:
            self._ensure_bucket()
        self._agent = agent
        self._next_dev_id = itertools.count(1)
        self._dev_id_lock = threading.Lock()
        self._lookup_pool = ThreadPoolExecutor(_LOOKUP_WINDOW, thread_name_prefix="s3-lookup")
        if agent is not None:
            ensure_obj_plugin_loadable()
            credentials = session.get_credentials()
            if credentials is None:
                raise ConfigError("store: no S3 credentials in the config or the AWS credential chain")
            frozen = credentials.get_frozen_credentials()
            params = {
                "bucket": config.bucket,
                "region": config.region,
                "access_key": frozen.access_key,
                "secret_key": frozen.secret_key,
                "use_virtual_addressing": "true" if config.addressing_style == "virtual" else "false",
                "num_threads": str(config.io_threads),
            }
            if frozen.token:
                params["session_token"] = frozen.token
            if config.endpoint:
                params["endpoint_override"] = config.endpoint
                params["scheme"] = config.endpoint.split("://", 1)[0]
            if config.ca_bundle:
                params["ca_bundle"] = config.ca_bundle
            agent.create_backend("OBJ", params)
        logger.info(
            "s3 store: bucket=%s endpoint=%s addressing=%s",
            config.bucket,
            config.endpoint or "<aws default>",
            config.addressing_style,
        )

    def _ensure_bucket(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.config.bucket)
        except ClientError:
            try:
                self._client.create_bucket(Bucket=self.config.bucket)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def _is_complete(self, key: str) -> bool:
        try:
            head = self._client.head_object(Bucket=self.config.bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return head["ContentLength"] == self.layout.full_block_bytes

    def lookup(self, keys: Sequence[str]) -> int:
        for start in range(0, len(keys), _LOOKUP_WINDOW):
            window = keys[start : start + _LOOKUP_WINDOW]
            for offset, present in enumerate(self._lookup_pool.map(self._is_complete, window)):
                if not present:
                    return start + offset
        return len(keys)

    def _transfer(self, op: str, keys: Sequence[str], addrs: Sequence[int], split_tail: bool) -> list[bool]:
        if self._agent is None:
            raise RuntimeError("S3Store was opened without a NIXL agent: lookup only")
        if not keys:
            return []
        size = self.layout.full_block_bytes
        with self._dev_id_lock:
            dev_ids = [next(self._next_dev_id) for _ in keys]
        registration = self._agent.register_memory(
            [(0, size, dev_id, key) for dev_id, key in zip(dev_ids, keys)], "OBJ"
        )
        # Local ranges and object ranges per chunk: (offset, length) pairs.
        ranges = [(0, size - 1), (size - 1, 1)] if split_tail else [(0, size)]
        transfers = [
            (
                descriptors([(addr + offset, length, 0) for offset, length in ranges]),
                descriptors([(offset, length, dev_id) for offset, length in ranges]),
            )
            for addr, dev_id in zip(addrs, dev_ids)
        ]
        results = run_nixl_transfers(self._agent, op, transfers, "OBJ", self.config.io_timeout_s)
        # Deregistered only after every transfer ended (TransferAbandoned skips this).
        self._agent.deregister_memory(registration)
        return results

    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        # A ranged GET past the end of a short object returns what exists and
        # NIXL reports success, so the last byte is fetched as its own range:
        # on a truncated object that range fails (416) and the chunk is
        # reported instead of returned as data.
        return self._transfer("READ", keys, dst_addrs, split_tail=True)

    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        # Objects are content-addressed, so re-putting an existing key stores
        # identical bytes; that is cheaper than a HEAD before every PUT. A PUT
        # is whole-object, hence one range.
        results = self._transfer("WRITE", keys, src_addrs, split_tail=False)
        for key, result in zip(keys, results):
            if not result:
                logger.warning("s3 store: write of %s failed", key)
        return results

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=False)
