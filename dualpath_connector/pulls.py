"""DE: pull a prefilled prompt's KV straight from the PE's KV cache (NIXL READ).

The READ carries ``pulled:<PE request id>:<hold token>``: its completion tells the PE it may
free the blocks it holds for this DE. A pull with nothing to copy (a local
prefix hit, an aborted request) only sends that notification.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from nixl_backends.transport import post_read

from dualpath_connector.kv_cache_view import KVCacheView
from dualpath_connector.metadata import PullSpec
from dualpath_connector.peer import PeerLink
from dualpath_connector.protocol import pulled_notification
from dualpath_connector.stats_recorder import StatsRecorder

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
        notification = pulled_notification(spec.remote_req_id, spec.remote_hold_token)
        ok = False
        try:
            peer = self.peers.peer(address, self.transfer_timeout_s)
            if not spec.block_ids:
                # Nothing to copy: only the PE's blocks to release.
                self.peers.notify(peer.agent, notification)
                return True
            local = self.view.regions
            if len(spec.remote_block_ids) == len(spec.block_ids) and self._same_block_geometry(local, peer):
                layers = list(range(self.view.num_layers))
                read = post_read(
                    self.agent,
                    peer.agent,
                    local.rows(layers, np.asarray(spec.block_ids)),
                    local.mem_type,
                    peer.rows(layers, np.asarray(spec.remote_block_ids)),
                    peer.mem_type,
                    notification,
                )
                ok = read.wait(self.transfer_timeout_s)
        except Exception as exc:
            logger.warning("request %s: pulling its prompt KV from PE %s failed: %s", spec.req_id, address, exc)
        if not spec.block_ids:
            return True
        if ok:
            nbytes = len(spec.block_ids) * self._bytes_per_block
            self.stats.add(bytes_pulled_from_peer=nbytes, pulled_tokens=len(spec.block_ids) * self.block_size)
            self.stats.sample("compute_network_bytes_per_request", nbytes)
        else:
            self.peers.forget(address)
            self.stats.add(pull_failed_tokens=len(spec.block_ids) * self.block_size)
            logger.warning("request %s: prompt KV not pulled from PE %s; recomputing it", spec.req_id, address)
        self.stats.sample("pull_seconds", time.perf_counter() - started)
        return ok

    @staticmethod
    def _same_block_geometry(local, peer) -> bool:
        if not local.same_block_geometry(peer):
            logger.warning("PE %s has another KV block geometry; prompts from it are recomputed", peer.agent)
            return False
        return True
