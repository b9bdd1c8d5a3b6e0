"""PE<->DE plumbing without vLLM: side channel, handshake, NIXL READ with notification, holds and leases.

Two NIXL agents in this process, each with UCX and a storage backend as the
connector's workers have, and each with its own :class:`PeerLink` (side
channel on a free port). Bytes move through UCX for real; "KV caches" are
plain registered buffers.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import pytest

from dualpath_connector.kv_regions import KVRegions
from dualpath_connector.peer import PeerLink
from dualpath_connector.protocol import PROTOCOL_VERSION, PULLED, RELEASE, VERSION_KEY, ReadRequest
from dualpath_connector.side_channel import PeerBusy, SideChannelError, request
from dualpath_dev.processes import free_port
from nixl_backends.buffers import HostBufferPool
from nixl_backends.transport import UCX, add_ucx_backend, post_read

BLOCK_BYTES = 4096
NUM_BLOCKS = 16
_names = itertools.count()


class Side:
    """An agent with a registered two-layer "KV cache" and a PeerLink."""

    def __init__(self, lease_s: float = 30.0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.agent = nixl_agent(
            f"peer-test-{os.getpid()}-{next(_names)}",
            nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT),
        )
        add_ucx_backend(self.agent)
        self.agent.create_backend("POSIX")
        rng = np.random.default_rng(next(_names))
        self.layers = [rng.integers(0, 256, NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in range(2)]
        self.registration = self.agent.register_memory(
            [(layer.ctypes.data, layer.nbytes, 0, "") for layer in self.layers], "DRAM", backends=[UCX]
        )
        self.pool = HostBufferPool(self.agent, BLOCK_BYTES, 4)
        self.reads: list[list[str]] = []
        self.deadlines: list[float] = []
        self.busy = False
        self.port = free_port()
        self.link = PeerLink(self.agent, "127.0.0.1", self.port, "ns-1", self.kv(), self.serve_read, lease_s)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kv(self) -> KVRegions:
        return KVRegions(
            layer_addrs=tuple(layer.ctypes.data for layer in self.layers),
            outer=1,
            outer_stride=NUM_BLOCKS * BLOCK_BYTES,
            block_bytes=BLOCK_BYTES,
            mem_type="DRAM",
            device_id=0,
        )

    def serve_read(self, read: ReadRequest, reply) -> None:
        chunk_hashes = read.chunk_hashes
        self.reads.append(chunk_hashes)
        self.deadlines.append(read.deadline_s)
        if self.busy:
            reply({"error": "queue too long", "busy": True})
            return
        slots = self.pool.acquire(len(chunk_hashes))
        reply({"readable": len(slots), "lease": self.link.lease(self.pool, slots), "chunk_addrs": [self.pool.slot_addr(s) for s in slots]})

    def close(self) -> None:
        self.link.close()
        self.pool.close()
        self.agent.deregister_memory(self.registration, backends=[UCX])


@pytest.fixture
def pair():
    pe, de = Side(), Side()
    yield pe, de
    de.close()
    pe.close()


def read_request(address: str, namespace: str, chunk_hashes: list[str], timeout_s: float) -> dict:
    return request(address, ReadRequest(namespace, chunk_hashes, timeout_s).to_message(), timeout_s)


def rows(layers: list[np.ndarray], blocks: list[int]) -> np.ndarray:
    return np.asarray(
        [(layer.ctypes.data + b * BLOCK_BYTES, BLOCK_BYTES, 0) for layer in layers for b in blocks], dtype=np.uint64
    )


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
    return value


def test_de_pulls_pe_blocks_and_the_notification_ends_the_hold(pair):
    pe, de = pair
    pe.link.hold("req-1", time.time() + 60)
    peer = de.link.peer(pe.address, timeout_s=5)
    assert peer.layer_addrs == tuple(layer.ctypes.data for layer in pe.layers)
    remote_blocks, local_blocks = [3, 7, 8], [0, 1, 15]
    read = post_read(
        de.agent, peer.agent, rows(de.layers, local_blocks), "DRAM", rows(pe.layers, remote_blocks), "DRAM", PULLED + b"req-1"
    )
    assert read.wait(10.0)
    for pe_layer, de_layer in zip(pe.layers, de.layers):
        for r, l in zip(remote_blocks, local_blocks):
            assert np.array_equal(de_layer[l * BLOCK_BYTES : (l + 1) * BLOCK_BYTES], pe_layer[r * BLOCK_BYTES : (r + 1) * BLOCK_BYTES])
    # The PE learns of the pull from the READ's notification alone.
    assert wait_for(pe.link.take_released_holds) == {"req-1"}


def test_a_hold_nobody_pulls_expires(pair):
    pe, _ = pair
    pe.link.hold("req-2", time.time() + 0.2)
    assert wait_for(pe.link.take_released_holds) == {"req-2"}


def test_de_side_read_lease_released_by_the_pe(pair):
    pe, de = pair
    answer = read_request(de.address, "ns-1", ["a", "b"], timeout_s=5)
    assert de.reads == [["a", "b"]] and de.deadlines == [5] and answer["readable"] == 2
    assert de.pool.free_slots == 2
    peer = pe.link.peer(de.address, timeout_s=5)
    pe.link.notify(peer.agent, RELEASE + answer["lease"].encode())
    wait_for(lambda: de.pool.free_slots == 4)


def test_unreleased_lease_expires():
    side = Side(lease_s=0.2)
    try:
        read_request(side.address, "ns-1", ["a"], timeout_s=5)
        assert side.pool.free_slots == 3
        wait_for(lambda: side.pool.free_slots == 4)
    finally:
        side.close()


def test_read_for_another_namespace_is_refused(pair):
    _, de = pair
    with pytest.raises(SideChannelError, match="namespace ns-2 is not this engine's"):
        read_request(de.address, "ns-2", ["a"], timeout_s=5)
    assert de.reads == []


def test_unknown_op_and_silent_peer_are_errors(pair):
    _, de = pair
    with pytest.raises(SideChannelError, match="unknown op"):
        request(de.address, {"op": "format-disk"}, timeout_s=5)
    started = time.monotonic()
    with pytest.raises(SideChannelError, match="no answer"):
        request(f"127.0.0.1:{free_port()}", {"op": "hello"}, timeout_s=0.5)
    assert time.monotonic() - started < 5


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    from nixl_backends.nixl_io import coalesce

    local = np.asarray([(0, 10, 0), (10, 10, 0), (20, 10, 0), (40, 10, 0), (50, 10, 0)], dtype=np.uint64)
    remote = np.asarray([(100, 10, 0), (110, 10, 0), (500, 10, 0), (510, 10, 0), (520, 10, 1)], dtype=np.uint64)
    merged_local, merged_remote = coalesce(local, remote)
    assert merged_local.tolist() == [[0, 20, 0], [20, 10, 0], [40, 10, 0], [50, 10, 0]]
    assert merged_remote.tolist() == [[100, 20, 0], [500, 10, 0], [510, 10, 0], [520, 10, 1]]


def test_a_busy_de_declines_with_peer_busy_and_lends_nothing(pair):
    _, de = pair
    de.busy = True
    with pytest.raises(PeerBusy, match="queue too long"):
        read_request(de.address, "ns-1", ["a"], timeout_s=5)
    assert de.pool.free_slots == 4
    # Any other refusal is a plain SideChannelError (the PE forgets that peer).
    with pytest.raises(SideChannelError) as refused:
        read_request(de.address, "other-namespace", ["a"], timeout_s=5)
    assert not isinstance(refused.value, PeerBusy)


def test_a_peer_of_another_protocol_version_is_refused_by_name(pair):
    _, de = pair
    for op in ("hello", "read"):
        message = {"op": op, VERSION_KEY: PROTOCOL_VERSION + 1, "namespace": "ns-1", "chunk_hashes": ["a"], "deadline_s": 5}
        with pytest.raises(SideChannelError, match=f"version {PROTOCOL_VERSION + 1}.*speaks {PROTOCOL_VERSION}"):
            request(de.address, message, 5)
    assert de.reads == []
    # Negative control: the same read with this side's version is served.
    assert request(de.address, {**message, VERSION_KEY: PROTOCOL_VERSION}, 5)["readable"] == 1


def test_a_malformed_read_is_refused_before_it_reaches_the_reader(pair):
    _, de = pair
    base = ReadRequest("ns-1", ["a"], 5).to_message()
    for bad in ({"chunk_hashes": "a"}, {"chunk_hashes": [1]}, {"deadline_s": -1}, {"deadline_s": "soon"}):
        with pytest.raises(SideChannelError, match="ProtocolError"):
            request(de.address, {**base, **bad}, 5)
    assert de.reads == []
