"""The ``s3`` backing: a bucket of an S3-compatible store, read by ranged GETs through NIXL OBJ."""

from __future__ import annotations

import logging

import numpy as np

from nixl_backends.obj_backend import OBJ, add_obj_backend, obj_device_ids
from nixl_backends.s3_endpoint import s3_session
from s3agg_gateway_ext.backing import Backing, RegisteredObjects, make_agent
from s3agg_gateway_ext.descriptor import Descriptor

logger = logging.getLogger(__name__)


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
    """One bucket's NIXL agent (UCX + OBJ), set up as the s3 store does. No HEAD per chunk: the descriptor's
    layout gives every size (Backing.check_objects)."""

    mem_type = OBJ

    def __init__(self, config, bucket: str) -> None:
        super().__init__(bucket)
        self.agent = make_agent(bucket)
        store = config.bucket_config(bucket)
        add_obj_backend(self.agent, store, s3_session(store))
        logger.info("bucket %s: NIXL agent %s, store endpoint %s, addressing %s", bucket, self.agent.name,
                    store.endpoint or "<aws default>", store.addressing_style)

    def objects(self, desc: Descriptor) -> RegisteredObjects:
        return _Registered(self.agent, desc)
