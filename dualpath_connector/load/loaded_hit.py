"""Where a fetched hit sits: :class:`LoadedHit`, in this engine's pool slots or a DE's buffer (:class:`RemoteBuffer`).

What a fetch (:mod:`~dualpath_connector.load.fetch`) hands on, a split read's join
(:mod:`~dualpath_connector.load.plan`) waits for, and injection
(:mod:`~dualpath_connector.load.inject`) copies from; here, below all three, so none of them imports another
for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dualpath_connector.cache.kv_regions import KVRegions
from dualpath_connector.load.arrivals import LayerArrivals
from dualpath_connector.metadata import ChunkLoad


@dataclass
class RemoteBuffer:
    """Hit chunks a DE read into its host buffer, leased to this engine until released.

    ``deadline`` (time.monotonic()): the DE's lease surely still runs before it;
    no READ of the buffer is posted, or trusted, after it (the DE hands the
    slots to other reads once its lease ends).
    """

    address: str
    peer: KVRegions
    lease: str
    chunk_addrs: list[int]  # each chunk's layer 0
    layer_stride: int  # from a chunk's layer l to its layer l + 1
    deadline: float

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline


@dataclass
class LoadedHit:
    """A hit whose leading readable chunks sit in a host buffer: this engine's pool slots, or a DE's.

    An arriving hit (``arrivals`` set) is in the pool only up to its last landed layer.
    """

    req_id: str
    chunks: list[ChunkLoad]
    slots: list[int] = field(default_factory=list)
    remote: RemoteBuffer | None = None
    arrivals: LayerArrivals | None = None

    def block_ids(self) -> np.ndarray:
        return np.asarray([b for c in self.chunks for b in c.block_ids], dtype=np.int64)
