"""Work stealing between the two storage links: a PE-side read offered to the DE while the PE's link is busy.

``HitReader.submit_here_or_move`` over a fake store and a fake side channel: the
offer happens only when this engine has reads queued and a measured rate, it
carries the time the read would take here as the DE's deadline (and the keep
token), a DE that accepts serves it (counted in ``reads_moved_to_de``), and a
DE that declines leaves it to this engine's own read, so no chunk is read twice.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from dualpath_connector.io_lanes import IOLane
from dualpath_connector.metadata import LoadSpec
from dualpath_connector.read_path import HitReader, LoadedHit
from dualpath_connector.read_timeline import ReadTimeline, load
from dualpath_connector.side_channel import PeerBusy, PeerTimeout, SideChannelError
from dualpath_connector.stats import StatsRecorder
from nixl_backends.buffers import HostBufferPool
from nixl_backends.integrity import ChunkIntegrity
from tests.unit.test_layer_arrival_injection import BLOCK, CHUNKS, KEY_SPACE, LAYOUT, FakeAgent, LayerwiseStore

PATIENT_S = 10.0
DE = "10.0.0.2:5700"
ACCEPTED = {"readable": len(CHUNKS), "lease": "lease-1", "chunk_addrs": [4096, 8192, 12288]}


class FakePeers:
    """The side channel as the reader uses it: one DE that answers ``answer`` (or raises it)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests: list[tuple[str, dict, float]] = []
        self.forgotten: list[str] = []

    def peer(self, address: str, timeout_s: float):
        return SimpleNamespace(agent="de-agent")

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        self.requests.append((address, message, timeout_s))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def forget(self, address: str) -> None:
        self.forgotten.append(address)


class Reported:
    def __init__(self) -> None:
        self.hits: list[LoadedHit] = []
        self.done = threading.Event()

    def __call__(self, hit: LoadedHit) -> None:
        self.hits.append(hit)
        self.done.set()


@pytest.fixture
def made():
    pool = HostBufferPool(FakeAgent(), LAYOUT.object_bytes, 8)
    store = LayerwiseStore(pool)
    store.delivers_layers = False
    readers = []

    def make(answer, *, move=True, queued_tokens=2000, rate=(1000, 1.0), timeline=None):
        lane = IOLane("test-read", None)
        reader = HitReader(store=store, pool=pool, block_size=BLOCK, key_space=KEY_SPACE,
                           integrity=ChunkIntegrity(LAYOUT), kv_dtype=torch.bfloat16, peers=FakePeers(answer),
                           lane=lane, stats=StatsRecorder(), de_read_timeout_s=10.0, cores=None,
                           move_queued_reads=move, timeline=timeline)  # fmt: skip
        if rate is not None:
            reader.read_queue.record_read(*rate)
        reader.read_queue.add(queued_tokens)  # reads of other requests, ahead of this one
        readers.append((reader, lane))
        return reader

    yield make, store
    for reader, lane in readers:
        reader.shutdown()
        assert lane.stop(PATIENT_S)
    pool.close()


def _submit(reader: HitReader, spec: LoadSpec) -> LoadedHit:
    reported = Reported()
    reader.submit_here_or_move(spec, reported)
    assert reported.done.wait(PATIENT_S)
    (hit,) = reported.hits
    return hit


def _spec(de: str | None = DE) -> LoadSpec:
    return LoadSpec("r1", list(CHUNKS), "pe", de, keep_token="ab" * 16)


def test_a_read_behind_a_busy_link_moves_to_a_de_that_finishes_sooner(made):
    make, store = made
    reader = make(ACCEPTED)
    hit = _submit(reader, _spec())

    assert hit.remote is not None and hit.remote.lease == "lease-1" and hit.chunks == CHUNKS
    assert store.whole_reads == []  # not read here as well
    ((address, message, timeout_s),) = reader.peers.requests
    # The deadline is when this engine would have finished it: 2000 tokens ahead + 5 blocks of 4, at 1000 tokens/s.
    assert address == DE and message["deadline_s"] == timeout_s == pytest.approx(2.02)
    assert message["keep_token"] == "ab" * 16  # the DE keeps it for its decode
    assert reader.stats.take().data["reads_moved_to_de"] == 1


def test_a_declined_move_is_read_here_once(made, tmp_path):
    make, store = made
    timeline = ReadTimeline(str(tmp_path), "pe-0")
    reader = make(PeerBusy("DE 10.0.0.2:5700 is busy: 9000 tokens queued ahead"), timeline=timeline)
    hit = _submit(reader, _spec())

    assert hit.remote is None and hit.chunks == CHUNKS and len(reader.peers.requests) == 1
    assert len(store.whole_reads) == 1
    assert reader.stats.take().data["reads_moved_to_de"] == 0
    reader.release([hit])
    # The read here is on this engine's timeline, once: 5 blocks of 4 tokens, 3 chunks read.
    timeline.close()
    ((record,),) = [load(tmp_path)]
    assert (record["engine"], record["kind"], record["tokens"], record["outcome"], record["chunks"]) == (
        "pe-0", "own", 20, "read", 3)  # fmt: skip


@pytest.mark.parametrize("late", [PeerTimeout("no answer from 10.0.0.2:5700 to 'read' within 2.0s"),
                                  SideChannelError("refused the answer of 10.0.0.2:5700 to 'read': bad signature")])
def test_a_late_de_stays_known_and_a_broken_one_is_forgotten(made, late):
    make, store = made
    reader = make(late)
    hit = _submit(reader, _spec())
    # Read here either way, and counted as a fallback.
    assert hit.remote is None and len(store.whole_reads) == 1
    assert reader.stats.take().data["de_read_fallbacks"] == 1
    # Late: other requests may be READing from that DE's buffer right now; only a broken answer drops it.
    assert reader.peers.forgotten == ([] if isinstance(late, PeerTimeout) else [DE])
    reader.release([hit])


@pytest.mark.parametrize(
    "case, options, de",
    [("idle link", {"queued_tokens": 0}, DE), ("rate not measured yet", {"rate": None}, DE),
     ("moving switched off", {"move": False}, DE), ("no DE named", {}, None)],
)  # fmt: skip
def test_no_offer_without_a_reason_or_a_de(made, case, options, de):
    make, store = made
    reader = make(ACCEPTED, **options)
    hit = _submit(reader, _spec(de))
    assert reader.peers.requests == [] and hit.remote is None and len(store.whole_reads) == 1, case
    reader.release([hit])


def test_a_long_queue_offers_at_most_the_de_read_timeout(made):
    make, _ = made
    reader = make(ACCEPTED, queued_tokens=10**7)
    _submit(reader, _spec())
    assert reader.peers.requests[0][2] == 10.0
