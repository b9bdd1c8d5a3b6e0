"""The ``s3`` backing: a bucket of an S3-compatible store, read by ranged GETs through NIXL OBJ."""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from nixl_backends.obj_backend import OBJ, add_obj_backend, obj_device_ids
from nixl_backends.s3_endpoint import object_size, s3_client, s3_session
from s3agg_gateway_ext.backing import Backing, RegisteredObjects, make_agent
from s3agg_gateway_ext.descriptor import Descriptor

logger = logging.getLogger(__name__)

_HEAD_THREADS = 16
_SIZE_CACHE_ENTRIES = 1 << 17  # objects are immutable: a verified size stays true


class _Registered(RegisteredObjects):
    def __init__(self, agent, desc: Descriptor) -> None:
        self._agent = agent
        ids = obj_device_ids(agent, desc.num_chunks)
        self._registration = agent.register_memory(
            [(0, desc.object_bytes, d, key) for d, key in zip(ids, desc.chunk_keys)], OBJ)
        self.dev_ids = np.arange(ids.start, ids.stop)

    def release(self) -> None:
        self._agent.deregister_memory(self._registration)


class S3Backing(Backing):
    """One bucket's NIXL agent (UCX + OBJ) and a boto3 client for HEADs, set up as the s3 store does."""

    mem_type = OBJ

    def __init__(self, config, bucket: str) -> None:
        super().__init__(bucket)
        self.agent = make_agent(bucket)
        store = config.bucket_config(bucket)
        session = s3_session(store)
        self._client = s3_client(store, session, _HEAD_THREADS)
        add_obj_backend(self.agent, store, session)
        logger.info("bucket %s: NIXL agent %s, store endpoint %s, addressing %s", bucket, self.agent.name,
                    store.endpoint or "<aws default>", store.addressing_style)
        self._sizes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._sizes_lock = threading.Lock()
        self._head_pool = ThreadPoolExecutor(_HEAD_THREADS, thread_name_prefix=f"head-{bucket}")

    def object_size(self, key: str) -> int | None:
        with self._sizes_lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                return self._sizes[key]
        size = object_size(self._client, self.bucket, key)
        if size is None:
            return None
        with self._sizes_lock:
            self._sizes[key] = size
            if len(self._sizes) > _SIZE_CACHE_ENTRIES:
                self._sizes.popitem(last=False)
        return size

    def check_objects(self, desc: Descriptor, map_=None) -> None:
        super().check_objects(desc, self._head_pool.map)  # HEADs in parallel

    def objects(self, desc: Descriptor) -> RegisteredObjects:
        return _Registered(self.agent, desc)

    def close(self) -> None:
        self._head_pool.shutdown(wait=False)
