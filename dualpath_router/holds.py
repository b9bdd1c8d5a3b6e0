"""Ending a PE's hold on a prefilled prompt when its DE will not pull it.

A PE keeps a finished prefill's KV blocks for the DE named in its hand-off until
the DE pulls them or ``pd_lease_s`` passes. When the DE refuses the request (a
4xx), every DE fails, or the client goes away before the decode finished, nobody
will pull; a DE that failed after the request may have reached it may have pulled,
so the router prefills again for the next DE and ends the first hold unless that
DE pulled it. The router sends the PE a ``release_hold`` on its side channel, signed
with the cluster key and carrying the hand-off's hold token (which only who saw
the hand-off knows), so the blocks return at once instead of after the lease.
One message per PE rank (rank ``r`` serves at the side channel's port + ``r``).

Without ``DUALPATH_CLUSTER_KEY`` in the router's environment it cannot sign the
message: it says so at start-up, and holds end at their lease as before.
"""

from __future__ import annotations

import asyncio
import logging

from nixl_backends.configuration import ConfigError

from dualpath_connector.pd.cluster_auth import CLUSTER_KEY_ENV, ClusterKey
from dualpath_connector.protocol import PrefillHandoff, ProtocolError, ReleaseHold
from dualpath_connector.pd.side_channel import SideChannelError, rank_address
from dualpath_connector.pd.side_channel import request as side_channel_request

logger = logging.getLogger(__name__)


class HoldReleaser:
    def __init__(self, key: ClusterKey | None, timeout_s: float) -> None:
        self.key = key
        self.timeout_s = timeout_s

    @classmethod
    def from_env(cls, timeout_s: float) -> HoldReleaser:
        try:
            key = ClusterKey.from_env()
        except ConfigError as exc:
            logger.warning("%s: the router cannot end a PE's hold when its DE refuses a request or the client goes "
                           "away; the blocks stay held until pd_lease_s (%s)", CLUSTER_KEY_ENV, exc)  # fmt: skip
            key = None
        return cls(key, timeout_s)

    async def release(self, handoff: PrefillHandoff, why: str) -> int:
        """Tell every rank of the PE to release the hold; how many ranks released one (0: pulled already, or gone).

        A rank whose hold has not registered yet (the PE's next step brings it) answers ``pending``: it ends
        the hold as it registers, so it counts as released.
        """
        if self.key is None:
            return 0
        message = ReleaseHold(handoff.remote_request_id, handoff.hold_token).to_message()
        released = 0
        for rank in range(handoff.tp_size):
            address = rank_address(handoff.remote_side_channel, rank)
            try:
                answer = await asyncio.to_thread(side_channel_request, address, message, self.timeout_s, self.key)
            except (SideChannelError, ProtocolError, OSError) as exc:
                logger.warning("request %s: could not release its hold on PE %s (%s); it ends at its lease",
                               handoff.remote_request_id, address, exc)  # fmt: skip
                continue
            released += answer.get("released") is True or answer.get("pending") is True
        logger.info("request %s: %s; PE hold released on %d of %d ranks", handoff.remote_request_id, why, released,
                    handoff.tp_size)  # fmt: skip
        return released
