"""Storage and transfer layer of dualpath-kv: every byte moves through NIXL.

The lowest package: it imports nothing else of the project. It owns the data
model (:mod:`nixl_backends.layout`), the host buffer pool registered with NIXL
once (:mod:`nixl_backends.buffers`) and the stores behind one interface
(:mod:`nixl_backends.store`, one backend per file).
"""

from nixl_backends.layout import BlockLayout, KVNamespace, chunk_hashes, chunk_key
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.store import KVStore

__all__ = [
    "BlockLayout",
    "KVNamespace",
    "KVStore",
    "chunk_hashes",
    "chunk_key",
    "make_store",
    "parse_store_config",
]
