"""The ``posix`` backing: a store root as ``nixl_backends.posix`` writes it, read where it lies.

ObjectCache aggregates inside the storage server; the equivalent shipped here
is a gateway on the node that holds the disks (or mounts the shared file
system): a request's layer slices of many chunk files are read in one NIXL
POSIX batch (every file opened once per request and registered as FILE
memory, its descriptor the fd), with no HTTP round trip per chunk. The same
gateway serves the root as an S3 bucket (:mod:`~s3agg_gateway_ext.s3_api`), so
writers and plain readers keep talking S3 to it.

Keys map to paths under the root exactly as ``PosixStore.path`` does; a key
that would leave the root (``..``, absolute, NUL) is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np

from nixl_backends.posix import IO_ENGINE_PARAMS
from s3agg_gateway_ext.backing import Backing, RegisteredObjects, make_agent
from s3agg_gateway_ext.descriptor import Descriptor, DescriptorError

logger = logging.getLogger(__name__)

FILE = "FILE"
MAX_KEY_BYTES = 1024  # S3's own limit


def safe_path(root: str, key: str) -> str:
    """``root/key``, or a 400 :class:`DescriptorError` for a key that is not a plain relative path under root."""
    parts = key.split("/")
    if (not key or len(key.encode()) > MAX_KEY_BYTES or "\0" in key or key.startswith("/")
            or any(part in ("", ".", "..") for part in parts)):
        raise DescriptorError(400, "InvalidObjectName", f"object key {key[:200]!r} is not a relative path of "
                                                         "non-empty segments without '.', '..' or NUL")
    return os.path.join(root, *parts)


class _OpenFiles(RegisteredObjects):
    def __init__(self, agent, paths: list[str], size: int) -> None:
        self._agent = agent
        self._fds: list[int] = []
        try:
            for path in paths:
                self._fds.append(os.open(path, os.O_RDONLY))
            # The fd is the FILE descriptor's device id; offsets are file offsets.
            self._registration = agent.register_memory([(0, size, fd, "") for fd in self._fds], FILE)
        except BaseException:
            self._close()
            raise
        self.dev_ids = np.asarray(self._fds, dtype=np.int64)

    def _close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def release(self) -> None:
        self._agent.deregister_memory(self._registration)
        self._close()


class PosixBacking(Backing):
    mem_type = FILE
    serves_s3 = True

    def __init__(self, config, bucket: str) -> None:
        super().__init__(bucket)
        store = config.store_config
        self.root = os.path.abspath(store.root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"store.root {self.root} is not a directory")
        self.agent = make_agent(bucket)
        self.agent.create_backend("POSIX", IO_ENGINE_PARAMS[store.io_engine])
        logger.info("bucket %s: NIXL agent %s, POSIX root %s (%s)", bucket, self.agent.name, self.root,
                    store.io_engine)

    def path(self, key: str) -> str:
        return safe_path(self.root, key)

    def check_objects(self, desc: Descriptor) -> None:
        """A stat per chunk file (no request to anyone): a missing file is 404, another size 400, named."""
        for key in desc.chunk_keys:
            try:
                size = os.stat(self.path(key)).st_size
            except FileNotFoundError:
                raise DescriptorError(404, "NoSuchKey", f"chunk object {key} does not exist") from None
            if size != desc.object_bytes:
                raise DescriptorError(
                    400, "InvalidObjectSize",
                    f"chunk object {key} has {size} bytes, descriptor says L*(S+D) = "
                    f"{desc.num_layers}*({desc.layer_bytes}+{desc.digest_bytes}) = {desc.object_bytes}",
                )

    def objects(self, desc: Descriptor) -> RegisteredObjects:
        return _OpenFiles(self.agent, [self.path(key) for key in desc.chunk_keys], desc.object_bytes)
