"""Where a served bucket's chunk objects live, and how the aggregator reads byte ranges of them.

One narrow interface, one file per backing (as NIXL's plugins), chosen by the
config's ``store.backend``:

- ``s3`` (:mod:`~s3agg_gateway_ext.backing_s3`): an S3-compatible store the
  gateway cannot sit next to; ranged GETs through NIXL OBJ, no HEADs (a
  request per object matters there: sizes come from the descriptor);
- ``posix`` (:mod:`~s3agg_gateway_ext.backing_posix`): a store root as
  ``nixl_backends.posix`` writes it, on the node that holds the disks (or
  mounts the shared file system); reads of many chunk files in one NIXL POSIX
  batch, and the gateway itself serves the root as an S3 bucket
  (``serves_s3``).

Each backing owns its bucket's NIXL agent (UCX for deliveries, plus its read
backend). The aggregator asks for the chunk objects of a request registered
for reads (:meth:`Backing.objects`): object ``j``'s byte ``o`` is then the
descriptor ``(o, length, dev_ids[j])`` of memory type :attr:`Backing.mem_type`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import numpy as np

from s3agg_gateway_ext.descriptor import Descriptor, DescriptorError


class RegisteredObjects(ABC):
    """A request's chunk objects, registered with the agent for reads."""

    dev_ids: np.ndarray  # per chunk, the device id its descriptors name

    @abstractmethod
    def release(self) -> None:
        """Deregister (and close); only once no transfer can still use them."""


class Backing(ABC):
    mem_type: str
    # Capability: the gateway answers plain S3 requests (GET/HEAD/PUT/DELETE/LIST) for this bucket itself.
    serves_s3: bool = False

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.agent = None

    def check_objects(self, desc: Descriptor) -> None:
        """Refuse the request before any read where a chunk object is missing or of another size than
        L*(S+D) (:class:`DescriptorError`), where the backing can tell cheaply.

        By default nothing is asked: the sizes are the descriptor's, and a short object is a failed chunk at
        its reader (the aggregator zeroes staged trailers before each read, so it arrives with zero digests).
        """

    @abstractmethod
    def objects(self, desc: Descriptor) -> RegisteredObjects:
        """The descriptor's chunk objects registered for reads; the caller releases them."""

    def close(self) -> None:
        """Release what the backing holds (not the agent: NIXL tears it down with the process)."""


def make_agent(name: str):
    """A NIXL agent with UCX (deliveries into clients' buffers), safe for the gateway's request threads.

    No progress thread: NIXL's busy-polls a whole core per agent, and every WRITE
    here is polled to completion anyway, which progresses UCX.
    """
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    return nixl_agent(
        f"s3agg-gw-{os.getpid()}-{name}",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT),
    )


def make_backing(config, bucket: str) -> Backing:
    """The backing of ``bucket`` for a validated :class:`~s3agg_gateway_ext.config.GatewayConfig`."""
    if config.backing == "posix":
        from s3agg_gateway_ext.backing_posix import PosixBacking

        return PosixBacking(config, bucket)
    from s3agg_gateway_ext.backing_s3 import S3Backing

    return S3Backing(config, bucket)
