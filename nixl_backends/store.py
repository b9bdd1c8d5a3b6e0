"""The KVStore interface and shared NIXL transfer plumbing (backends: :mod:`nixl_backends.registry`).

A store holds Full Blocks, one immutable object/file per chunk, named by
:func:`nixl_backends.layout.chunk_key`. The interface is deliberately narrow:
leading-run lookup, read Full Blocks into registered host memory, write Full
Blocks from it, close. Backends declare what they can do in
:class:`StoreCapabilities`; callers never probe.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from nixl_backends.layout import BlockLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreCapabilities:
    """What a backend offers, declared once per backend class."""

    # Reads may name a byte range of a Full Block (what layerwise readers need).
    ranged_reads: bool
    # Other nodes see the same keys (a shared file system or an object store).
    shared_across_nodes: bool


class TransferAbandoned(RuntimeError):
    """Transfers still in flight at their deadline.

    NIXL may still write their memory, so the caller must neither reuse nor
    deregister it; the store leaves its own registrations in place too.
    """

    def __init__(self, op: str, pending: int, timeout_s: float) -> None:
        super().__init__(f"NIXL {op}: {pending} transfers still in flight after {timeout_s:.1f}s")


class KVStore(ABC):
    """Leading-run lookup, Full Block reads and writes through NIXL."""

    capabilities: ClassVar[StoreCapabilities]

    def __init__(self, layout: BlockLayout) -> None:
        self.layout = layout

    @abstractmethod
    def lookup(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are present as complete Full Blocks.

        Control path only (no NIXL agent needed): the scheduler calls it.
        """

    @abstractmethod
    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        """Read each key's Full Block into registered DRAM at the matching address.

        Returns one flag per key; a missing, short or unreadable chunk is
        ``False`` and its destination bytes must not be trusted. Raises
        :class:`TransferAbandoned` when transfers outlive the store's timeout.
        """

    @abstractmethod
    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        """Store each Full Block found in registered DRAM at the matching address.

        Chunks are content-addressed and immutable: writing a key that already
        exists stores the same bytes again or is skipped, and counts as written.
        """

    def close(self) -> None:
        """Release backend resources; the store is unusable afterwards."""


def run_nixl_transfers(
    agent,
    op: str,
    transfers: Sequence[tuple[np.ndarray, np.ndarray]],
    remote_mem_type: str,
    timeout_s: float,
) -> list[bool]:
    """Post every transfer at once, then wait for all; one flag per transfer.

    Each transfer is a pair of Nx3 ``(addr_or_offset, length, dev_id)`` arrays:
    local DRAM descriptors and the backend-side descriptors. One NIXL request
    per chunk lets a single bad chunk fail alone. Raises
    :class:`TransferAbandoned` if any is still in flight after ``timeout_s``.
    """
    handles: list[Any] = []
    for local, remote in transfers:
        try:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, remote_mem_type),
                agent.name,
            )
            if agent.transfer(handle) == "ERR":
                agent.release_xfer_handle(handle)
                handle = None
        except Exception as exc:  # NIXL raises nixlBackendError and friends per request
            logger.debug("NIXL %s could not start: %s", op, exc)
            handle = None
        handles.append(handle)

    ok = [h is not None for h in handles]
    pending = {i for i, h in enumerate(handles) if h is not None}
    deadline = time.monotonic() + timeout_s
    while pending:
        for i in list(pending):
            try:
                state = agent.check_xfer_state(handles[i])
            except Exception as exc:
                logger.debug("NIXL %s failed: %s", op, exc)
                state = "ERR"
            if state == "PROC":
                continue
            pending.discard(i)
            ok[i] = state == "DONE"
            agent.release_xfer_handle(handles[i])
        if pending:
            if time.monotonic() > deadline:
                # A handle still in flight cannot be released safely: NIXL may
                # still write its memory, so it is left to NIXL, and so is
                # the memory (the caller must not reuse it).
                raise TransferAbandoned(op, len(pending), timeout_s)
            time.sleep(0.0002)
    return ok


def descriptors(rows: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """Nx3 uint64 descriptor array, the form NIXL converts without a Python loop."""
    return np.asarray(rows, dtype=np.uint64).reshape(-1, 3)
