"""DE: pull a prefilled prompt's KV straight from the PE's KV cache (NIXL READ).

First the DE claims the PE's hold on the blocks (side channel): the PE grants a
claim once, and only while the hold lives, for ``claim_s`` seconds. The READ is
posted only before the claim's deadline and trusted only if it ended before it;
otherwise the blocks may already hold another request's KV, and vLLM recomputes
the prompt here instead. The READ carries ``pulled:<PE request id>:<claim token>``:
its completion tells the PE it may free the blocks. A pull with nothing to copy
(a local prefix hit, an aborted request) only sends ``pulled:`` with the
hand-off's hold token.

A push-mode proxy's hand-off has neither the blocks nor the hold token: its
claim names the request alone and the PE's answer names the blocks; with
nothing to copy, the claim's token ends the hold.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from nixl_backends.transport import post_read

from dualpath_connector.cache.kv_cache_view import KVCacheView
from dualpath_connector.metadata import PullSpec
from dualpath_connector.pd.peer import PeerLink
from dualpath_connector.protocol import HoldClaim, pulled_notification
from dualpath_connector.pd.side_channel import SideChannelError
from dualpath_connector.metrics.stats_recorder import StatsRecorder

logger = logging.getLogger(__name__)


class PromptPuller:
    def __init__(
        self,
        *,
        agent,
        view: KVCacheView,
        peers: PeerLink,
        block_size: int,
        stats: StatsRecorder,
        transfer_timeout_s: float,
    ) -> None:
        self.agent = agent
        self.view = view
        self.peers = peers
        self.block_size = block_size
        self.stats = stats
        self.transfer_timeout_s = transfer_timeout_s
        # A pulled block: its bytes in every layer, as the cache holds them.
        self._bytes_per_block = view.num_layers * view.outer * view.block_bytes

    def pull(self, spec: PullSpec) -> bool:
        """Copy ``spec``'s blocks from the PE; False if they did not all arrive (vLLM recomputes them)."""
        started = time.perf_counter()
        address = spec.remote_side_channel
        ok, healthy = False, True
        try:
            peer = self.peers.peer(address, self.transfer_timeout_s)
            if not spec.block_ids:
                # Nothing to copy: only the PE's blocks to release.
                token = spec.remote_hold_token or self._claim(spec)[0].claim_token
                self.peers.notify(peer.agent, pulled_notification(spec.remote_req_id, token))
                return True
            local = self.view.regions
            matched = spec.remote_block_ids is None or len(spec.remote_block_ids) == len(spec.block_ids)
            if matched and self._same_block_geometry(local, peer):
                ok = self._claimed_read(spec, peer, local)
        except SideChannelError as exc:
            # Refused (the hold ended or was claimed) or late, not known to be gone: other pulls may be READing
            # from it right now, and forgetting it would fail them.
            logger.warning("request %s: PE %s did not lend its prompt KV: %s", spec.req_id, address, exc)
        except Exception as exc:
            healthy = False
            logger.warning("request %s: pulling its prompt KV from PE %s failed: %s", spec.req_id, address, exc)
        if not spec.block_ids:
            return True
        if ok:
            nbytes = len(spec.block_ids) * self._bytes_per_block
            self.stats.add(bytes_pulled_from_peer=nbytes, pulled_tokens=len(spec.block_ids) * self.block_size)
            self.stats.sample("compute_network_bytes_per_request", nbytes)
        else:
            if not healthy:
                self.peers.forget(address)
            self.stats.add(pull_failed_tokens=len(spec.block_ids) * self.block_size)
            logger.warning("request %s: prompt KV not pulled from PE %s; recomputing it", spec.req_id, address)
        self.stats.sample("pull_seconds", time.perf_counter() - started)
        return ok

    def _claimed_read(self, spec: PullSpec, peer, local) -> bool:
        """Claim the PE's hold, then READ within the claim: True only if the READ ended before its deadline."""
        claim, deadline = self._claim(spec)
        remote = spec.remote_block_ids
        if remote is None:  # a push hand-off: the claim names the PE's blocks
            remote = (claim.remote_block_ids or [])[spec.remote_first_block:][: len(spec.block_ids)]
            if len(remote) != len(spec.block_ids):
                logger.warning("request %s: the PE's claim named %d of the %d blocks from block %d on",
                               spec.req_id, len(remote), len(spec.block_ids), spec.remote_first_block)  # fmt: skip
                # Nothing was read: the claim's token ends the hold now.
                self.peers.notify(peer.agent, pulled_notification(spec.remote_req_id, claim.claim_token))
                return False
        layers = list(range(self.view.num_layers))
        if time.monotonic() >= deadline:
            logger.warning("request %s: the PE's claim ended before the READ could start", spec.req_id)
            return False
        read = post_read(
            self.agent,
            peer.agent,
            local.rows(layers, np.asarray(spec.block_ids)),
            local.mem_type,
            peer.rows(layers, np.asarray(remote)),
            peer.mem_type,
            pulled_notification(spec.remote_req_id, claim.claim_token),
        )
        # wait() returns False only once the READ can no longer write here; a READ seen ending after the
        # deadline may have read blocks the PE had freed by then, so its bytes are not trusted either.
        ok = read.wait(min(self.transfer_timeout_s, deadline - time.monotonic()))
        if ok and time.monotonic() >= deadline:
            logger.warning("request %s: the READ of its prompt KV ended after the PE's claim did", spec.req_id)
            return False
        return ok

    def _claim(self, spec: PullSpec) -> tuple[HoldClaim, float]:
        """The PE's claim of ``spec``'s hold and its READ deadline (:meth:`PeerLink.claim`)."""
        return self.peers.claim(spec.remote_side_channel, spec.remote_req_id, spec.remote_hold_token,
                                self.transfer_timeout_s)  # fmt: skip

    @staticmethod
    def _same_block_geometry(local, peer) -> bool:
        if not local.same_block_geometry(peer):
            logger.warning("PE %s has another KV block geometry; prompts from it are recomputed", peer.agent)
            return False
        return True
