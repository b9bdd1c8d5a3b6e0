"""Engine-to-engine transfers over NIXL's UCX backend (PE <-> DE).

Peers exchange agent metadata out of band (the connector's side channel),
then one engine READs registered memory of the other: the DE pulls a prefilled
prompt's KV blocks from the PE, the PE pulls DE-read Full Blocks from the DE's
host buffer. A READ may carry a notification, which NIXL delivers to the peer
once the READ is complete; that is how the owner learns it may reuse the memory.
"""

from __future__ import annotations

import logging

import numpy as np

from nixl_backends.nixl_io import coalesce, wait_until
from nixl_backends.traffic_isolation import UcxTraffic

logger = logging.getLogger(__name__)

UCX = "UCX"


def add_ucx_backend(agent, traffic: UcxTraffic | None = None, where: str = "transport.") -> None:
    """Give ``agent`` a UCX backend; call before registering memory peers will read.

    ``traffic`` (the connector's ``transport`` section) becomes UCX_* variables of this
    process first: UCX reads them when the backend creates its context.
    """
    variables = traffic.apply(where) if traffic is not None else {}
    if variables:
        logger.info("UCX backend for KV transfers with %s",
                    " ".join(f"{name}={value}" for name, value in sorted(variables.items())))  # fmt: skip
    # "peer": a vanished peer fails its transfers instead of hanging them.
    agent.create_backend(UCX, {"ucx_error_handling_mode": "peer"})


def mem_type(device_type: str) -> str:
    return "DRAM" if device_type == "cpu" else "VRAM"


# How often a READ NIXL could not cancel yet is checked, and canceled again.
CANCEL_RETRY_S = 1.0


class PeerRead:
    """One posted READ from a peer's registered memory into local registered memory."""

    def __init__(self, agent, handle) -> None:
        self._agent = agent
        self._handle = handle
        self._state = "PROC"

    def state(self) -> str:
        """``"PROC"``, ``"DONE"``, ``"ERR"`` or ``"CANCELED"``; a finished READ releases its handle."""
        if self._state != "PROC":
            return self._state
        try:
            self._state = self._agent.check_xfer_state(self._handle)
        except Exception as exc:  # nixlRemoteDisconnectError and friends
            logger.warning("NIXL READ from a peer failed: %s", exc)
            self._state = "ERR"
        if self._state != "PROC":
            self._agent.release_xfer_handle(self._handle)
        return self._state

    def wait(self, timeout_s: float) -> bool:
        """True once the bytes are here; False on error, or once a READ still running at the deadline is canceled.

        Never False while the READ can still write the local memory: the caller
        reuses that memory next (vLLM recomputes into the blocks, the store is
        read into them), and a READ landing after that would overwrite it with
        the peer's bytes, partial blocks and all: a wrong answer.
        """
        if not wait_until(self._ended, timeout_s):
            logger.warning("NIXL READ from a peer still in flight after %.1fs; canceling it", timeout_s)
            self.cancel()
        return self._state == "DONE"

    def cancel(self) -> None:
        """End the READ if it still runs; returns once it can no longer write the local memory.

        NIXL cancels an active transfer when its handle is released, or refuses
        (and keeps the handle) while it cannot; then the READ is waited for, and
        canceled again, until one of the two ends it. With UCX's peer error
        handling a vanished peer ends it with an error.
        """
        warned = False
        while not self._ended():
            try:
                self._agent.release_xfer_handle(self._handle)
            except Exception as exc:
                if not warned:
                    logger.warning("NIXL cannot cancel a READ from a peer yet (%s); waiting for it to end", exc)
                    warned = True
                wait_until(self._ended, CANCEL_RETRY_S)
                continue
            self._state = "CANCELED"

    def _ended(self) -> bool:
        return self.state() != "PROC"


def post_read(
    agent,
    peer: str,
    local: np.ndarray,
    local_mem_type: str,
    remote: np.ndarray,
    remote_mem_type: str,
    notification: bytes = b"",
) -> PeerRead:
    """Post a READ of ``remote`` rows (peer memory) into ``local`` rows; Nx3 descriptor arrays.

    Raises if NIXL cannot even start the READ (unknown peer, unregistered memory).
    """
    local, remote = coalesce(local, remote)
    handle = agent.initialize_xfer(
        "READ",
        agent.get_xfer_descs(local, local_mem_type),
        agent.get_xfer_descs(remote, remote_mem_type),
        peer,
        notification,
        backends=[UCX],
    )
    read = PeerRead(agent, handle)
    if agent.transfer(handle) == "ERR":
        agent.release_xfer_handle(handle)
        raise RuntimeError(f"NIXL could not post a READ from peer {peer}")
    return read
