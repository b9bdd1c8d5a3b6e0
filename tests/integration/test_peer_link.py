"""PE<->DE plumbing without vLLM: side channel, handshake, NIXL READ with notification, holds and leases.

Two NIXL agents in this process, each with UCX and a storage backend as the
connector's workers have, and each with its own :class:`PeerLink` (side
channel on a free port). Bytes move through UCX for real; "KV caches" are
plain registered buffers. Both sides hold the cluster key
(``DUALPATH_CLUSTER_KEY``); the last tests play peers and servers without it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time

import numpy as np
import pytest

import zmq

from dualpath_connector.pd.cluster_auth import (
    CLUSTER_KEY_ENV,
    ClusterKey,
    open_answer,
    open_request,
    seal_answer,
    seal_request,
)
from dualpath_connector.cache.kv_regions import KVRegions
from dualpath_connector.pd.peer import PeerLink
from dualpath_connector.protocol import (
    PROTOCOL_VERSION,
    PULLED,
    RELEASE,
    VERSION_KEY,
    ProtocolError,
    ReadRequest,
    ReleaseHold,
    hello_message,
    pulled_notification,
)
from dualpath_connector.pd.side_channel import (
    MAX_MESSAGE_BYTES,
    RECEIVE_QUEUE,
    PeerBusy,
    PeerGone,
    PeerTimeout,
    SideChannelError,
    request,
)
from nixl_backends.configuration import ConfigError
from dualpath_dev.processes import free_port
from nixl_backends.buffers import HostBufferPool
from nixl_backends.transport import UCX, add_ucx_backend, post_read

BLOCK_BYTES = 4096
NUM_BLOCKS = 16
_names = itertools.count()
CLUSTER_SECRET = "peer-link-test-cluster-secret"
KEY = ClusterKey(CLUSTER_SECRET.encode())
WRONG_KEY = ClusterKey(b"not-this-cluster's-secret")


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch):
    """What every PD engine of a cluster has in its environment."""
    monkeypatch.setenv(CLUSTER_KEY_ENV, CLUSTER_SECRET)


class Side:
    """An agent with a registered two-layer "KV cache" and a PeerLink."""

    def __init__(self, lease_s: float = 30.0, port: int | None = None, tp_rank: int = 0, tp_size: int = 1,
                 claim_s: float = 30.0) -> None:
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
        self.read_s = 0.0
        self.port = free_port() if port is None else port  # the engine's: rank r serves at port + r
        self.link = PeerLink(
            self.agent, "127.0.0.1", self.port, "ns-1", self.kv(), self.serve_read, lease_s, claim_s, tp_rank=tp_rank,
            tp_size=tp_size,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kv(self) -> KVRegions:
        return KVRegions(
            layer_addrs=tuple(layer.ctypes.data for layer in self.layers),
            outer=1,
            outer_stride=NUM_BLOCKS * BLOCK_BYTES,
            num_blocks=NUM_BLOCKS,
            block_stride=BLOCK_BYTES,
            block_bytes=BLOCK_BYTES,
            mem_type="DRAM",
            device_id=0,
        )

    def serve_read(self, read: ReadRequest, reply) -> None:
        received = time.monotonic()
        time.sleep(self.read_s)  # a store read that takes this long (not synchronisation)
        chunk_hashes = read.chunk_hashes
        self.reads.append(chunk_hashes)
        self.deadlines.append(read.deadline_s)
        if self.busy:
            reply({"error": "queue too long", "busy": True})
            return
        slots = self.pool.acquire(len(chunk_hashes))
        lease, lease_s = self.link.lease(self.pool, slots, received, read.keep_token, chunk_hashes)
        reply({"readable": len(slots), "lease": lease, "chunk_addrs": [self.pool.slot_addr(s) for s in slots],
               "layer_stride": BLOCK_BYTES, "lease_s": lease_s})

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


def read_request(address: str, namespace: str, chunk_hashes: list[str], timeout_s: float, keep_token=None) -> dict:
    return request(address, ReadRequest(namespace, chunk_hashes, timeout_s, keep_token).to_message(), timeout_s)


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


TOKEN = "5a" * 16  # the hand-off's hold token


def test_de_pulls_pe_blocks_and_the_notification_ends_the_hold(pair):
    pe, de = pair
    pe.link.hold("req-1", time.time() + 60, TOKEN, list(range(3)))
    assert pe.link.held_blocks == 3
    peer = de.link.peer(pe.address, timeout_s=5)
    assert peer.layer_addrs == tuple(layer.ctypes.data for layer in pe.layers)
    claimed_at = time.monotonic()
    claim, deadline = de.link.claim(pe.address, "req-1", TOKEN, timeout_s=5)
    assert claim.claim_s == 30.0 and claimed_at + 30.0 <= deadline <= time.monotonic() + 30.0
    remote_blocks, local_blocks = [3, 7, 8], [0, 1, 15]
    read = post_read(
        de.agent, peer.agent, rows(de.layers, local_blocks), "DRAM", rows(pe.layers, remote_blocks), "DRAM",
        pulled_notification("req-1", claim.claim_token),
    )
    assert read.wait(10.0)
    for pe_layer, de_layer in zip(pe.layers, de.layers):
        for r, l in zip(remote_blocks, local_blocks):
            assert np.array_equal(de_layer[l * BLOCK_BYTES : (l + 1) * BLOCK_BYTES], pe_layer[r * BLOCK_BYTES : (r + 1) * BLOCK_BYTES])
    # The PE learns of the pull from the READ's notification alone.
    assert wait_for(pe.link.take_released_holds) == {"req-1"} and pe.link.held_blocks == 0


def test_a_flood_of_forged_pulled_notifications_does_not_crowd_out_the_genuine_one(pair):
    """Tokens are checked as notifications arrive. 5,000 forged ones for no hold, then 100 for the victim's hold
    with a wrong token, then the genuine one: it still ends the hold. Notifications of one connection arrive in
    order, so before the check (one table of 4,096 pulls, refusing more once full) the flood had filled the
    table when the genuine one came, every time."""
    pe, de = pair
    peer = de.link.peer(pe.address, timeout_s=5)
    pe.link.hold("victim", time.time() + 60, TOKEN, list(range(5)))
    forgeries = pe.link.forged_notifications
    for i in range(5000):
        de.link.notify(peer.agent, pulled_notification(f"nobody-{i}", f"{i:032x}"))
    for i in range(100):
        de.link.notify(peer.agent, pulled_notification("victim", f"{i:032x}"))
    de.link.notify(peer.agent, pulled_notification("victim", TOKEN))
    pe.link.hold("barrier", time.time() + 60, TOKEN, [0])
    de.link.notify(peer.agent, pulled_notification("barrier", TOKEN))
    ended: set[str] = set()
    assert wait_for(lambda: ended.update(pe.link.take_released_holds()) or ended >= {"victim", "barrier"})
    assert pe.link.held_blocks == 0
    # The wrong tokens for the victim count at once, and so do the pulls for no hold evicted past 4,096.
    assert pe.link.forged_notifications >= forgeries + 100 + (5000 - 4096)


def test_forged_pulled_notifications_end_no_hold(pair):
    """Anyone reaching the UCX listener can send a notification: without the hand-off's token it ends nothing."""
    pe, de = pair
    peer = de.link.peer(pe.address, timeout_s=5)
    pe.link.hold("victim", time.time() + 60, TOKEN, list(range(5)))
    for forged in (PULLED + b"victim", pulled_notification("victim", "00" * 16), PULLED + b"victim:not-hex",
                   pulled_notification("nobody", TOKEN)):  # fmt: skip
        de.link.notify(peer.agent, forged)
    # A barrier behind the forgeries: once its hold ends, every forgery before it was handled.
    pe.link.hold("barrier", time.time() + 60, TOKEN, [0])
    de.link.notify(peer.agent, pulled_notification("barrier", TOKEN))
    assert wait_for(pe.link.take_released_holds) == {"barrier"}
    assert pe.link.held_blocks == 5  # the victim's blocks stay held
    # Refused: no token, the wrong token, a malformed one (the one for no hold waits a lease, then counts too).
    assert pe.link.forged_notifications >= 3
    # Control: the right token ends it.
    de.link.notify(peer.agent, pulled_notification("victim", TOKEN))
    assert wait_for(pe.link.take_released_holds) == {"victim"} and pe.link.held_blocks == 0


def test_a_router_releases_a_hold_with_its_token_only(pair):
    pe, _ = pair
    pe.link.hold("refused-by-de", time.time() + 60, TOKEN, list(range(4)))
    key = KEY
    wrong = request(pe.address, ReleaseHold("refused-by-de", "00" * 16).to_message(), 5, key)
    assert wrong == {"released": False, "pending": False} and pe.link.held_blocks == 4
    right = request(pe.address, ReleaseHold("refused-by-de", TOKEN).to_message(), 5, key)
    assert right == {"released": True, "pending": False} and pe.link.held_blocks == 0
    assert pe.link.take_released_holds() == {"refused-by-de"}
    again = request(pe.address, ReleaseHold("refused-by-de", TOKEN).to_message(), 5, key)
    assert again == {"released": False, "pending": False}  # ended already: nothing is waited for


def test_a_release_before_its_hold_registers_ends_it_as_it_registers(pair):
    """A DE can refuse a request, and the router release its hold, before the PE's next step registers it."""
    pe, _ = pair
    key = KEY
    early = request(pe.address, ReleaseHold("refused-early", TOKEN).to_message(), 5, key)
    forged = request(pe.address, ReleaseHold("other-request", "00" * 16).to_message(), 5, key)
    assert early == {"released": False, "pending": True} and forged["pending"] is True
    pe.link.hold("refused-early", time.time() + 60, TOKEN, list(range(4)))
    assert pe.link.held_blocks == 0 and pe.link.take_released_holds() == {"refused-early"}
    # The control: a release with another token ends nothing; the hold stays until its own token comes.
    forgeries = pe.link.forged_notifications
    pe.link.hold("other-request", time.time() + 60, TOKEN, list(range(3)))
    assert pe.link.held_blocks == 3 and pe.link.forged_notifications == forgeries + 1
    assert pe.link.take_released_holds() == set()


def test_a_hold_nobody_pulls_expires(pair):
    pe, _ = pair
    pe.link.hold("req-2", time.time() + 0.2, TOKEN, [0])
    assert wait_for(pe.link.take_released_holds) == {"req-2"}


# -- claims: a hand-off is READ once, and only while its hold lives ---------------------------------


def blocks_bytes(layers: list[np.ndarray], blocks: list[int]) -> list[bytes]:
    return [layer[b * BLOCK_BYTES : (b + 1) * BLOCK_BYTES].tobytes() for layer in layers for b in blocks]


def sync_notifications(pe: Side, de: Side) -> None:
    """A pull behind what ``de`` sent ``pe`` before: once its hold ends, everything before it was handled."""
    pe.link.hold("sync", time.time() + 60, TOKEN, [0])
    de.link.notify(de.link.peer(pe.address, timeout_s=5).agent, pulled_notification("sync", TOKEN))
    assert "sync" in wait_for(pe.link.take_released_holds)


def test_a_de_that_comes_after_the_hold_ended_is_refused_before_it_reads_reused_blocks(pair):
    """The PE's hold expired, vLLM gave its blocks to another request: a DE's claim now is refused, so it
    recomputes; without the claim (the control) its READ brings the other request's KV."""
    pe, de = pair
    pe.link.hold("late", time.time() + 0.2, TOKEN, list(range(2)))
    prompt_kv = blocks_bytes(pe.layers, [3, 4])
    assert "late" in wait_for(pe.link.take_released_holds)  # expired: vLLM frees the blocks after this step
    for layer in pe.layers:  # ... and another request's forward writes its own KV there
        layer[3 * BLOCK_BYTES : 5 * BLOCK_BYTES] = 7
    with pytest.raises(SideChannelError, match="hold of request late: no hold"):
        de.link.claim(pe.address, "late", TOKEN, timeout_s=5)
    assert pe.link.refused_claims == 1
    # The control: a DE that READs without claiming (protocol 5 did) gets bytes that are not its prompt's KV.
    peer = de.link.peer(pe.address, timeout_s=5)
    read = post_read(de.agent, peer.agent, rows(de.layers, [0, 1]), "DRAM", rows(pe.layers, [3, 4]), "DRAM")
    assert read.wait(10.0)
    assert blocks_bytes(de.layers, [0, 1]) != prompt_kv


def test_a_handoff_is_claimed_once_and_its_claim_alone_ends_the_hold(pair):
    """A second DE given the same hand-off (a router retry) is refused while the first reads and after; neither
    a router release nor a pulled: with the hand-off's token ends a claimed hold: only its READ does."""
    pe, de = pair
    second = Side()
    try:
        pe.link.hold("once", time.time() + 60, TOKEN, list(range(2)))
        claim, _ = de.link.claim(pe.address, "once", TOKEN, timeout_s=5)
        with pytest.raises(SideChannelError, match="claimed already"):
            second.link.claim(pe.address, "once", TOKEN, timeout_s=5)
        assert request(pe.address, ReleaseHold("once", TOKEN).to_message(), 5, KEY) == {"released": False,
                                                                                        "pending": False}
        second.link.notify(second.link.peer(pe.address, timeout_s=5).agent, pulled_notification("once", TOKEN))
        sync_notifications(pe, second)
        assert pe.link.held_blocks == 2  # still the first DE's
        peer = de.link.peer(pe.address, timeout_s=5)
        read = post_read(de.agent, peer.agent, rows(de.layers, [0, 1]), "DRAM", rows(pe.layers, [5, 6]), "DRAM",
                         pulled_notification("once", claim.claim_token))  # fmt: skip
        assert read.wait(10.0) and blocks_bytes(de.layers, [0, 1]) == blocks_bytes(pe.layers, [5, 6])
        assert wait_for(pe.link.take_released_holds) == {"once"} and pe.link.held_blocks == 0
        with pytest.raises(SideChannelError, match="no hold"):
            second.link.claim(pe.address, "once", TOKEN, timeout_s=5)
        with pytest.raises(SideChannelError, match="wrong hold token"):
            pe.link.hold("other", time.time() + 60, TOKEN, [0])
            second.link.claim(pe.address, "other", "00" * 16, timeout_s=5)
        assert pe.link.refused_claims == 3
    finally:
        second.close()


def test_a_push_handoffs_claim_names_the_blocks_is_granted_once_and_its_token_alone_ends_the_hold(pair):
    """A push-mode proxy drops the hold token: the DE claims by request id over the signed side channel and the
    answer names the held blocks; a second claim (token or not) is refused, and only the claim's token ends it."""
    pe, de = pair
    second = Side()
    try:
        pe.link.hold("pushed", time.time() + 60, TOKEN, [11, 4, 7])
        claim, _ = de.link.claim(pe.address, "pushed", "", timeout_s=5)
        assert claim.remote_block_ids == [11, 4, 7]
        for token in ("", TOKEN):
            with pytest.raises(SideChannelError, match="claimed already"):
                second.link.claim(pe.address, "pushed", token, timeout_s=5)
        # A claim with the token is answered without the blocks: its DE has them.
        pe.link.hold("pulled", time.time() + 60, TOKEN, [1])
        assert second.link.claim(pe.address, "pulled", TOKEN, timeout_s=5)[0].remote_block_ids is None
        peer = de.link.peer(pe.address, timeout_s=5)
        de.link.notify(peer.agent, pulled_notification("pushed", TOKEN))  # the hand-off's token: not the claim's
        sync_notifications(pe, de)
        assert pe.link.held_blocks == 4
        de.link.notify(peer.agent, pulled_notification("pushed", claim.claim_token))
        assert wait_for(pe.link.take_released_holds) == {"pushed"} and pe.link.held_blocks == 1
    finally:
        second.close()


def test_a_claim_before_its_hold_registers_is_answered_when_it_does(pair):
    pe, de = pair
    answer: dict = {}
    claimer = threading.Thread(target=lambda: answer.update(claim=de.link.claim(pe.address, "early", TOKEN, 10)))
    claimer.start()
    wait_for(lambda: "early" in pe.link._early_claims)  # waiting on the PE, unanswered
    pe.link.hold("early", time.time() + 60, TOKEN, list(range(3)))
    claimer.join(10)
    assert answer["claim"][0].claim_s == 30.0 and pe.link.refused_claims == 0


def test_a_claim_for_a_hold_that_never_registers_is_refused_in_half_a_claim():
    pe, de = Side(claim_s=0.4), Side()
    try:
        with pytest.raises(SideChannelError, match="no hold registered here within 0.2s"):
            de.link.claim(pe.address, "never", TOKEN, timeout_s=10)
    finally:
        de.close()
        pe.close()


def test_a_claimed_hold_whose_read_never_ends_is_released_when_the_claim_ends():
    """The claim replaces the hold's lease: a DE that claimed and vanished pins the blocks claim_s, not 60 s."""
    pe, de = Side(claim_s=0.3), Side()
    try:
        pe.link.hold("vanished", time.time() + 60, TOKEN, list(range(2)))
        _, deadline = de.link.claim(pe.address, "vanished", TOKEN, timeout_s=5)
        assert wait_for(pe.link.take_released_holds) == {"vanished"}
        assert time.monotonic() >= deadline  # never before the DE's own deadline
    finally:
        de.close()
        pe.close()


def test_a_de_lease_answer_ends_no_earlier_than_the_pe_counts_it():
    """The PE reads a DE's buffer only until sent + lease_s: the DE frees the slots no earlier than that."""
    pe, de = Side(), Side(lease_s=0.3)
    de.read_s = 0.5  # the lease begins after the store read, well after the request came in
    try:
        sent = time.monotonic()
        answer = read_request(de.address, "ns-1", ["a", "b"], timeout_s=5)
        assert answer["lease_s"] >= 0.8
        wait_for(lambda: de.pool.free_slots == 4)
        assert time.monotonic() >= sent + answer["lease_s"]
    finally:
        de.close()
        pe.close()


def test_de_side_read_lease_released_by_the_pe(pair):
    pe, de = pair
    answer = read_request(de.address, "ns-1", ["a", "b"], timeout_s=5)
    assert de.reads == [["a", "b"]] and de.deadlines == [5] and answer["readable"] == 2
    assert de.pool.free_slots == 2
    peer = pe.link.peer(de.address, timeout_s=5)
    pe.link.notify(peer.agent, RELEASE + answer["lease"].encode())
    wait_for(lambda: de.pool.free_slots == 4)


def test_unreleased_lease_expires(caplog):
    side = Side(lease_s=0.2)
    try:
        answer = read_request(side.address, "ns-1", ["a"], timeout_s=5)
        assert answer["readable"] == 1 and side.reads == [["a"]]  # one slot lent
        # The slot comes back by expiry alone (checked by outcome, not by timing:
        # a stall of this process may outlast the 0.2 s lease).
        wait_for(lambda: side.pool.free_slots == 4)
        assert f"buffer lease {answer['lease']} expired before the PE released it" in caplog.text
    finally:
        side.close()


# -- DE-read hits kept for the DE's own decode (paper §4.1) ------------------------


def release_and_sync(pe: Side, de: Side, lease: str) -> None:
    """The PE's release, then a notification behind it: once that one is seen, the release was handled."""
    peer = pe.link.peer(de.address, timeout_s=5)
    de.link.hold("barrier", time.time() + 60, TOKEN, [0])
    pe.link.notify(peer.agent, RELEASE + lease.encode())
    pe.link.notify(peer.agent, pulled_notification("barrier", TOKEN))
    assert wait_for(de.link.take_released_holds) == {"barrier"}


def test_a_released_lease_with_a_keep_token_is_kept_until_claimed(pair):
    pe, de = pair
    answer = read_request(de.address, "ns-1", ["a", "b"], timeout_s=5, keep_token="aa" * 16)
    release_and_sync(pe, de, answer["lease"])
    # Released by the PE, yet not back in the pool: kept for the decode.
    assert (de.pool.free_slots, de.link.kept_slots) == (2, 2)
    pool, slots, hashes = de.link.claim_kept("aa" * 16)
    assert pool is de.pool and hashes == ["a", "b"] and len(slots) == 2
    assert de.link.kept_slots == 0 and de.link.claim_kept("aa" * 16) is None  # claimed once
    pool.release(slots)
    assert de.pool.free_slots == 4


def test_a_keep_claimed_before_the_pe_released_is_not_freed_twice(pair):
    pe, de = pair
    answer = read_request(de.address, "ns-1", ["a"], timeout_s=5, keep_token="bb" * 16)
    pool, slots, hashes = de.link.claim_kept("bb" * 16)
    assert hashes == ["a"]
    pool.release(slots)
    release_and_sync(pe, de, answer["lease"])  # the late release finds nothing
    assert (de.pool.free_slots, de.link.kept_slots) == (4, 0)
    assert de.pool.acquire(4) is not None  # every slot once, none twice


def test_a_lease_without_a_keep_token_is_freed_on_release(pair):
    pe, de = pair
    answer = read_request(de.address, "ns-1", ["a"], timeout_s=5)
    release_and_sync(pe, de, answer["lease"])
    assert (de.pool.free_slots, de.link.kept_slots) == (4, 0)
    assert de.link.claim_kept("cc" * 16) is None


def test_a_kept_hit_nobody_claims_expires(caplog):
    pe, de = Side(), Side(lease_s=0.3)
    try:
        answer = read_request(de.address, "ns-1", ["a", "b"], timeout_s=5, keep_token="dd" * 16)
        peer = pe.link.peer(de.address, timeout_s=5)
        pe.link.notify(peer.agent, RELEASE + answer["lease"].encode())
        wait_for(lambda: de.pool.free_slots == 4)
        assert de.link.claim_kept("dd" * 16) is None
    finally:
        de.close()
        pe.close()


def test_a_keep_token_used_twice_frees_the_older_slots(pair):
    pe, de = pair
    first = read_request(de.address, "ns-1", ["a"], timeout_s=5, keep_token="ee" * 16)
    second = read_request(de.address, "ns-1", ["b"], timeout_s=5, keep_token="ee" * 16)
    release_and_sync(pe, de, first["lease"])
    release_and_sync(pe, de, second["lease"])
    assert (de.pool.free_slots, de.link.kept_slots) == (3, 1)
    assert de.link.claim_kept("ee" * 16)[2] == ["b"]


def test_read_for_another_namespace_is_refused(pair):
    _, de = pair
    with pytest.raises(SideChannelError, match="namespace ns-2 is not this engine's"):
        read_request(de.address, "ns-2", ["a"], timeout_s=5)
    assert de.reads == []


def test_unknown_op_is_an_error(pair):
    _, de = pair
    with pytest.raises(SideChannelError, match="unknown op"):
        request(de.address, {"op": "format-disk"}, timeout_s=5)


def test_a_peer_gone_is_known_at_once_and_a_silent_one_at_the_deadline():
    """A killed or restarted engine (its connection closed, or its port refusing) is PeerGone as soon as the
    connection says so, not after the deadline: a PE asking a dead DE to read a hit reads it itself at once.
    The control: a peer that is up and silent (another cluster's key, a hung process) still costs the deadline."""
    patient_s = 60.0  # what waiting out the deadline would cost; each PeerGone below comes in milliseconds
    started = time.monotonic()
    with pytest.raises(PeerGone, match="refused the connection before answering 'hello'"):
        request(f"127.0.0.1:{free_port()}", hello_message(), patient_s, KEY)
    context = zmq.Context()
    try:
        closing = context.socket(zmq.ROUTER)
        closing.setsockopt(zmq.LINGER, 0)
        port = closing.bind_to_random_port("tcp://127.0.0.1")

        def take_then_close() -> None:
            closing.recv_multipart()  # the request arrived: the peer dies before answering
            closing.close()

        server = threading.Thread(target=take_then_close)
        server.start()
        with pytest.raises(PeerGone, match="closed the connection before answering 'hello'"):
            request(f"127.0.0.1:{port}", hello_message(), patient_s, KEY)
        server.join(timeout=5)
        assert time.monotonic() - started < patient_s / 2
        silent = context.socket(zmq.ROUTER)
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(PeerTimeout, match="no answer .* within 0.5s"):
            request(f"127.0.0.1:{port}", hello_message(), 0.5, KEY)
        silent.close()
    finally:
        context.term()


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


# -- authentication ------------------------------------------------------------------


def test_a_pd_engine_without_the_cluster_key_does_not_start(monkeypatch):
    monkeypatch.delenv(CLUSTER_KEY_ENV)
    port = free_port()
    with pytest.raises(ConfigError, match=f"{CLUSTER_KEY_ENV} is not set"):
        PeerLink(None, "127.0.0.1", port, "ns-1", None, None, 30.0)
    monkeypatch.setenv(CLUSTER_KEY_ENV, "too-short")
    with pytest.raises(ConfigError, match=f"{CLUSTER_KEY_ENV} is shorter") as refused:
        PeerLink(None, "127.0.0.1", port, "ns-1", None, None, 30.0)
    assert "too-short" not in str(refused.value)
    # Nothing listens: the refusal came before the side channel bound its port.
    with pytest.raises(PeerGone, match="refused the connection"):
        request(f"127.0.0.1:{port}", hello_message(), 30, KEY)


class RawPeer:
    """A ZeroMQ DEALER that sends whatever frames it is given, as a port scanner or an old release would."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"tcp://{address}")

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def answered(self, timeout_s: float) -> bool:
        return bool(self.socket.poll(int(timeout_s * 1000), zmq.POLLIN))

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def raw_peer(pair):
    peer = RawPeer(pair[1].address)
    yield peer
    peer.close()


def test_a_keyholder_nesting_past_the_bound_gets_an_error_and_the_channel_serves_on(pair, raw_peer):
    _, de = pair
    body = b'{"op": "hello", "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    frame, nonce = seal_request(KEY, body)
    raw_peer.send(b"", frame)
    assert raw_peer.answered(10)
    answer = json.loads(open_answer(KEY, raw_peer.socket.recv_multipart()[1], nonce))
    assert answer == {"error": "malformed side-channel message or unknown op"}
    assert "error" not in request(de.address, hello_message(), 5, KEY)


def test_a_frame_over_the_size_bound_drops_its_peer_and_the_channel_serves_on(pair, raw_peer):
    _, de = pair
    assert de.link._server._router.getsockopt(zmq.RCVHWM) == RECEIVE_QUEUE  # what bounds a peer's queue in count
    raw_peer.send(b"", b"\0" * (MAX_MESSAGE_BYTES + 1))
    assert not raw_peer.answered(1.0)
    assert "error" not in request(de.address, hello_message(), 5, KEY)


def test_unauthenticated_peers_get_nothing_and_one_warning(pair, raw_peer, caplog):
    _, de = pair
    hello = json.dumps(hello_message()).encode()
    signed, _ = seal_request(KEY, hello)
    bad = [
        (b"", hello),  # an older release: plain JSON
        (b"", seal_request(WRONG_KEY, hello)[0]),  # another cluster's key
        (b"", signed[:-1]),  # truncated
        (b"", signed[:40]),  # truncated inside the header
        (b"", signed[:-1] + bytes([signed[-1] ^ 1])),  # tampered body
        (b"", seal_request(KEY, hello, now=time.time() - 300)[0]),  # stale
        (b"", signed, b"extra frame"),
        (b"not a delimiter", signed),
        (b"",),
        (b"", os.urandom(500)),
    ] * 3
    with caplog.at_level(logging.WARNING, logger="dualpath_connector.pd.side_channel"):
        for frames in bad:
            raw_peer.send(*frames)
        wait_for(lambda: de.link.rejected_messages == len(bad))
        # Through the client, with another cluster's key: no answer, not even an error.
        with pytest.raises(SideChannelError, match="no answer"):
            request(de.address, hello_message(), 0.5, WRONG_KEY)
        wait_for(lambda: de.link.rejected_messages == len(bad) + 1)
        # Negative control: the same hello signed with the cluster key is served.
        assert request(de.address, hello_message(), 5)["agent"] == de.agent.name
        assert not raw_peer.answered(0.2)
    warnings = [r for r in caplog.records if r.name == "dualpath_connector.pd.side_channel"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "older dualpath-kv release" in warnings[0].getMessage() and "127.0.0.1" in warnings[0].getMessage()
    assert CLUSTER_SECRET not in caplog.text
    assert de.reads == []


def test_a_replayed_request_is_served_once(pair, raw_peer):
    _, de = pair
    frame, _ = seal_request(KEY, json.dumps(ReadRequest("ns-1", ["a"], 5).to_message()).encode())
    raw_peer.send(b"", frame)
    assert raw_peer.answered(5)
    raw_peer.socket.recv_multipart()
    raw_peer.send(b"", frame)
    wait_for(lambda: de.link.rejected_messages == 1)
    assert not raw_peer.answered(0.2)
    assert de.reads == [["a"]]


class FakeServer:
    """A side channel that answers each request with ``answer(request_nonce) -> frame``: a fake or old DE."""

    def __init__(self, answer) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._answer = answer
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{self.address}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(20, zmq.POLLIN):
                identity, _, frame = self._socket.recv_multipart()
                nonce = open_request(KEY, frame).nonce
                self._socket.send_multipart([identity, b"", self._answer(nonce)])
        self._socket.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def fake_server():
    servers = []

    def start(answer) -> FakeServer:
        servers.append(FakeServer(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_a_forged_answer_is_refused_by_the_client(pair, fake_server):
    pe, _ = pair
    forged = json.dumps({VERSION_KEY: PROTOCOL_VERSION, "agent": "evil", "metadata": "", "namespace": "ns-1",
                         "kv": pe.kv().to_wire()}).encode()  # fmt: skip
    earlier_nonce = seal_request(KEY, b"{}")[1]
    cases = {
        "unsigned (an older release)": (lambda nonce: forged, "older dualpath-kv release"),
        "another key": (lambda nonce: seal_answer(WRONG_KEY, forged, nonce), "bad signature"),
        "an answer to another request": (lambda nonce: seal_answer(KEY, forged, earlier_nonce), "another request"),
        "a request reflected back": (lambda nonce: seal_request(KEY, forged)[0], "a request where an answer"),
    }
    for name, (answer, reason) in cases.items():
        fake = fake_server(answer)
        with pytest.raises(SideChannelError, match=f"refused the answer of {fake.address}.*{reason}"):
            pe.link.peer(fake.address, timeout_s=5)
    # Negative control: the same answer, signed with the key and naming its request, is taken.
    fake = fake_server(lambda nonce: seal_answer(KEY, forged, nonce))
    assert request(fake.address, hello_message(), 5)["agent"] == "evil"


def test_each_tp_rank_serves_at_port_plus_rank_and_handshakes_only_with_the_same_rank_of_the_same_size():
    port = free_port(2)
    pe = [Side(port=port, tp_rank=r, tp_size=2) for r in range(2)]
    de = [Side(tp_rank=r, tp_size=2) for r in range(2)] + [Side(tp_rank=1, tp_size=4)]
    try:
        # Each DE rank names the PE by rank 0's address and reaches its own rank's agent and KV cache.
        for rank in range(2):
            assert de[rank].link.peer(pe[0].address, 5.0).layer_addrs == pe[rank].kv().layer_addrs
        with pytest.raises(ProtocolError, match="rank 1 of tensor parallel size 2, this is rank 1 of 4"):
            de[2].link.peer(pe[0].address, 5.0)
    finally:
        for side in pe + de:
            side.close()
