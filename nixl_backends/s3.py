"""S3 backend: Full Blocks as objects, data through NIXL's OBJ plugin, control through boto3.

Works with any S3-compatible endpoint (SeaweedFS, MinIO, Ceph RGW, AWS S3).
Addressing is path-style by default (what on-prem stores expect) or
virtual-hosted. Credentials come from the config or the standard AWS chain;
the secret key is never logged or shown in a repr. The config section and the
boto3 side live in :mod:`nixl_backends.s3_endpoint`, the OBJ plugin in
:mod:`nixl_backends.obj_backend`; the gateway uses both too.
"""

from __future__ import annotations

import ctypes
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from nixl_backends.deadlines import seconds_left
from nixl_backends.layout import DIGEST_BYTES, BlockLayout
from nixl_backends.nixl_io import TransferAbandoned, descriptors, run_nixl_transfers
from nixl_backends.obj_backend import OBJ, add_obj_backend, obj_device_ids
from nixl_backends.s3_endpoint import (
    S3StoreConfig,
    delete_objects,
    ensure_bucket,
    object_size,
    s3_client,
    s3_session,
)
from nixl_backends.store import KVStore, StoreMetrics
from nixl_backends.window import InFlightWindow

__all__ = ["S3Store", "S3StoreConfig"]

logger = logging.getLogger(__name__)

_LOOKUP_WINDOW = 16  # HEADs in flight at once during a leading-run lookup


class S3Store(KVStore):
    def __init__(self, config: S3StoreConfig, layout: BlockLayout, agent=None) -> None:
        super().__init__(layout)
        self.config = config
        session = s3_session(config)
        self._client = s3_client(config, session, _LOOKUP_WINDOW)
        # Also without create_bucket: wrong credentials must stop start-up, not turn every request into a miss.
        ensure_bucket(self._client, config.bucket, create=config.create_bucket)
        self._agent = agent
        self._counts_lock = threading.Lock()
        self._retried = 0  # payload requests sent again after they failed
        self._not_retried = 0  # failed payload requests not sent again: their load's deadline was too near
        self._lookup_pool = ThreadPoolExecutor(_LOOKUP_WINDOW, thread_name_prefix="s3-lookup")
        # One link, one window: reads and writes measure and share it.
        self.window = InFlightWindow(min(config.io_window_min, config.io_threads), config.io_threads)
        if agent is not None:
            add_obj_backend(agent, config, session)
        logger.info(
            "s3 store: bucket=%s endpoint=%s addressing=%s",
            config.bucket,
            config.endpoint or "<aws default>",
            config.addressing_style,
        )

    def _is_complete(self, key: str) -> bool:
        return object_size(self._client, self.config.bucket, key) == self.layout.object_bytes

    def lookup(self, keys: Sequence[str]) -> int:
        for start in range(0, len(keys), _LOOKUP_WINDOW):
            window = keys[start : start + _LOOKUP_WINDOW]
            for offset, present in enumerate(self._lookup_pool.map(self._is_complete, window)):
                if not present:
                    return start + offset
        return len(keys)

    def _transfer(self, op: str, keys: Sequence[str], addrs: Sequence[int],
                  before: Callable[[int], None] = lambda i: None,
                  landed: Callable[[int], bool] = lambda i: True) -> list[bool]:  # fmt: skip
        """One request per object, those that failed sent again (``io_retries``, never past the load's deadline:
        :mod:`nixl_backends.deadlines`); ``before(i)`` runs before each attempt at object ``i``, ``landed(i)``
        says whether one NIXL reported done really is."""
        if self._agent is None:
            raise RuntimeError("S3Store was opened without a NIXL agent: lookup only")
        if not keys:
            return []
        size = self.layout.object_bytes
        dev_ids = obj_device_ids(self._agent, len(keys))
        registration = self._agent.register_memory(
            [(0, size, dev_id, key) for dev_id, key in zip(dev_ids, keys)], OBJ
        )
        # One request per object: the whole object, one range.
        transfers = [(descriptors(addr, size), descriptors(0, size, dev_id)) for addr, dev_id in zip(addrs, dev_ids)]
        results = [False] * len(keys)
        failed = list(range(len(keys)))
        for attempt in range(1 + self.config.io_retries):
            if attempt:
                pause = random.uniform(0, min(self.config.io_retry_cap_s, self.config.io_retry_base_s * 2 ** (attempt - 1)))
                left = seconds_left()
                if left is not None and left <= pause:
                    # The forward waits for this load: recomputing what failed is sooner than another round.
                    logger.info("s3 store: %d of %d %s requests failed; not sent again, %.3fs left of their load's "
                                "deadline", len(failed), len(keys), op, left)  # fmt: skip
                    with self._counts_lock:
                        self._not_retried += len(failed)
                    break
                logger.info("s3 store: %d of %d %s requests failed; sending them again in %.3fs", len(failed),
                            len(keys), op, pause)  # fmt: skip
                with self._counts_lock:
                    self._retried += len(failed)
                time.sleep(pause)  # backoff: the store may be shedding load (503 SlowDown)
            for i in failed:
                before(i)
            # The link's bandwidth-delay product in flight, at most as many requests as the plugin has threads: a
            # write (the save lane) then queues behind at most one round of a read's GETs, not the whole hit.
            try:
                outcome = run_nixl_transfers(self._agent, op, [transfers[i] for i in failed], OBJ,
                                             self.config.io_timeout_s, window=self.window)  # fmt: skip
            except TransferAbandoned as exc:
                exc.when_ended(lambda: self._agent.deregister_memory(registration))
                raise
            for i, ok in zip(failed, outcome):
                results[i] = ok and landed(i)
            failed = [i for i in failed if not results[i]]
            if not failed:
                break
        # Deregistered only after every transfer ended (when abandoned: by whoever holds the exception's handles).
        self._agent.deregister_memory(registration)
        return results

    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        # One GET per object. A GET of a short object returns what exists and NIXL reports success (so may one
        # the store answered with an error the SDK gave up on), so each destination's trailer is zeroed before
        # each attempt: what the answer does not overwrite stays zero. Short by 16 bytes or more, its last
        # digest is all zero (a real one is, once in 2^128): a failed read, sent again like any. Shorter, its
        # last digest is part zero and fails the reader's integrity check.
        trailers = [addr + self.layout.full_block_bytes for addr in dst_addrs]
        last = self.layout.trailer_bytes - DIGEST_BYTES
        zero = bytes(DIGEST_BYTES)
        return self._transfer(
            "READ", keys, dst_addrs,
            before=lambda i: ctypes.memset(trailers[i], 0, self.layout.trailer_bytes),
            landed=lambda i: (ctypes.c_char * DIGEST_BYTES).from_address(trailers[i] + last).raw != zero,
        )  # fmt: skip

    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        # Objects are content-addressed, so re-putting an existing key stores
        # identical bytes; that is cheaper than a HEAD before every PUT. A PUT
        # is whole-object, hence one range.
        results = self._transfer("WRITE", keys, src_addrs)
        for key, result in zip(keys, results):
            if not result:
                logger.warning("s3 store: write of %s failed", key)
        return results

    def metrics(self) -> StoreMetrics:
        with self._counts_lock:
            return StoreMetrics(counters={"s3_requests_retried": self._retried,
                                          "s3_retries_past_deadline": self._not_retried})

    def delete(self, keys: Sequence[str]) -> None:
        for key, code in delete_objects(self._client, self.config.bucket, keys).items():
            logger.warning("s3 store: could not delete %s: %s", key, code)

    def close(self) -> None:
        self._lookup_pool.shutdown(wait=False)
