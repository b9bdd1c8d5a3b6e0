"""The KVStore interface (backends: :mod:`nixl_backends.registry`).

A store holds chunk objects (a Full Block and its integrity trailer,
:attr:`BlockLayout.object_bytes`), one immutable object/file per chunk, named by
:func:`nixl_backends.layout.chunk_key`. The interface is deliberately narrow:
leading-run lookup, read objects into registered host memory, write them from
it, delete, close. Stores move bytes; they do not interpret them (the reader
verifies the trailer: :mod:`nixl_backends.integrity`). The NIXL plumbing the backends share is in
:mod:`nixl_backends.nixl_io`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from nixl_backends.layout import BlockLayout
# Raised by every read and write; callers import it from here.
from nixl_backends.nixl_io import TransferAbandoned

__all__ = ["KVStore", "StoreMetrics", "TransferAbandoned"]


@dataclass
class StoreMetrics:
    """What a store reports about itself (names: ``dualpath_connector.protocol`` documents them)."""

    counters: dict[str, int] = field(default_factory=dict)  # totals since the store was opened
    gauges: dict[str, float] = field(default_factory=dict)  # latest values


class KVStore(ABC):
    """Leading-run lookup, Full Block reads and writes through NIXL."""

    # A store that can hand over a read layer by layer as each lands (``read_layerwise``, e.g. the
    # s3agg gateway's), so a reader can start using layer 0 before the last layer arrives.
    delivers_layers: bool = False
    # A store that reads an object straight into pieces of host memory (``read_segments``): a
    # layer-major pool's slot (``HostBufferPool.slot_segments``), with no copy after the read.
    reads_segments: bool = False

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are present as complete Full Blocks.

        Control path only (no NIXL agent needed): the scheduler calls it.
        """

    @abstractmethod
    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        """Read each key's object into registered DRAM at the matching address.

        Returns one flag per key; a missing, short or unreadable chunk is
        ``False`` and its destination bytes must not be trusted. Raises
        :class:`TransferAbandoned` when transfers outlive the store's timeout.
        """

    def read_segments(self, keys: Sequence[str], segments: Sequence[np.ndarray]) -> list[bool]:
        """Like :meth:`read`, each object into its pieces: ``k x 2`` rows ``(addr, length)`` in object byte order.

        Only where ``reads_segments`` is declared.
        """
        raise NotImplementedError(f"{type(self).__name__} reads whole objects into one run only")

    @abstractmethod
    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        """Store each object found in registered DRAM at the matching address.

        Chunks are content-addressed and immutable: writing a key that already
        exists stores the same bytes again or is skipped, and counts as written.
        """

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove these chunks (absent ones are fine); a reader then finds a miss, never part of an object.

        Control path (no NIXL agent needed): a reader drops a chunk that
        failed its integrity check, so the next save can store it again.
        """

    def metrics(self) -> StoreMetrics:
        """Counters and gauges of the store's own (tiers, paths, evictions); none by default."""
        return StoreMetrics()

    def close(self) -> None:
        """Release backend resources; the store is unusable afterwards."""

