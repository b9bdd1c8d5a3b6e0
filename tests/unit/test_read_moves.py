"""Work stealing between the two storage links: a PE-side read offered to the DE, whole or split.

``HitReader.plan`` and ``HitReader.fetch`` over a fake store and a fake side channel: the
offer happens only when this engine has a measured rate and either reads queued
(the whole read moves) or a hit long enough to split (the DE reads the tail while
this engine reads the head); it carries the time the whole read would take here as
the DE's deadline (and the keep token), a DE that accepts serves it (counted in
``reads_moved_to_de`` / ``split_read_tail_tokens``), and a DE that declines leaves
it to this engine's own read, so no chunk is read twice. A split read's parts
always form a prefix of the hit. ``plan_read`` (where the split falls) is pure.
"""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from dualpath_connector.lanes.io_lanes import IOLane
from dualpath_connector.load.read_queue import StoreReadQueue
from dualpath_connector.metadata import LoadSpec
from dualpath_connector.protocol import RELEASE
from dualpath_connector.load.loaded_hit import LoadedHit
from dualpath_connector.load.fetch import HitReader
from dualpath_connector.load.plan import ReadPlan, plan_read
from dualpath_connector.load.read_timeline import ReadTimeline, load
from dualpath_connector.pd.side_channel import PeerBusy, PeerTimeout, SideChannelError
from dualpath_connector.metrics.stats_recorder import StatsRecorder
from nixl_backends.buffers import HostBufferPool
from nixl_backends.deadlines import seconds_left
from nixl_backends.integrity import ChunkIntegrity
from tests.unit.test_layer_arrival_injection import BLOCK, CHUNKS, HASHES, KEY_SPACE, LAYOUT, FakeAgent, LayerwiseStore

PATIENT_S = 10.0
DE = "10.0.0.2:5700"
ACCEPTED = {"readable": len(CHUNKS), "lease": "lease-1", "chunk_addrs": [4096, 8192, 12288],
            "layer_stride": LAYOUT.layer_block_bytes, "lease_s": 120.0}


class FakePeers:
    """The side channel as the reader uses it: one DE that answers ``answer`` (or raises it)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests: list[tuple[str, dict, float]] = []
        self.forgotten: list[str] = []
        self.notified: list[bytes] = []

    def peer(self, address: str, timeout_s: float):
        return SimpleNamespace(agent="de-agent")

    def request(self, address: str, message: dict, timeout_s: float) -> dict:
        self.requests.append((address, message, timeout_s))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def forget(self, address: str) -> None:
        self.forgotten.append(address)

    def notify(self, agent: str, message: bytes) -> None:
        self.notified.append(message)


class Reported:
    def __init__(self) -> None:
        self.calls: list[list[LoadedHit]] = []
        self.done = threading.Event()

    def __call__(self, parts: list[LoadedHit]) -> None:
        self.calls.append(parts)
        self.done.set()


@pytest.fixture
def made():
    pool = HostBufferPool(FakeAgent(), LAYOUT.object_bytes, 8)
    store = LayerwiseStore(pool)
    store.delivers_layers = False
    readers = []

    def make(answer, *, move=True, queued_tokens=2000, rate=1000.0, timeline=None, split_min_tokens=0):
        lane = IOLane("test-read", None)
        reader = HitReader(store=store, pool=pool, block_size=BLOCK, key_space=KEY_SPACE,
                           integrity=ChunkIntegrity(LAYOUT), kv_dtype=torch.bfloat16, peers=FakePeers(answer),
                           lane=lane, stats=StatsRecorder(), de_read_timeout_s=10.0, cores=None,
                           move_queued_reads=move, split_read_min_tokens=split_min_tokens,
                           timeline=timeline)  # fmt: skip
        reader.read_queue = StoreReadQueue(initial_tokens_per_s=rate)  # as if measured (None: not yet)
        reader.read_queue.add(queued_tokens)  # reads of other requests, ahead of this one
        readers.append((reader, lane))
        return reader

    yield make, store
    for reader, lane in readers:
        reader.shutdown()
        assert lane.stop(PATIENT_S)
    pool.close()


def _submit_parts(reader: HitReader, spec: LoadSpec) -> list[LoadedHit]:
    reported = Reported()
    reader.fetch(spec, reader.plan(spec), reported)
    assert reported.done.wait(PATIENT_S)
    (parts,) = reported.calls
    return parts


def _submit(reader: HitReader, spec: LoadSpec) -> LoadedHit:
    (hit,) = _submit_parts(reader, spec)
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
    assert reader.stats.take()["reads_moved_to_de"] == 1


def test_a_declined_move_is_read_here_once(made, tmp_path):
    make, store = made
    timeline = ReadTimeline(str(tmp_path), "pe-0")
    reader = make(PeerBusy("DE 10.0.0.2:5700 is busy: 9000 tokens queued ahead"), timeline=timeline)
    hit = _submit(reader, _spec())

    assert hit.remote is None and hit.chunks == CHUNKS and len(reader.peers.requests) == 1
    assert len(store.whole_reads) == 1
    assert reader.stats.take()["reads_moved_to_de"] == 0
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
    assert reader.stats.take()["de_read_fallbacks"] == 1
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



@pytest.mark.parametrize("move", [True, False])
def test_a_read_the_router_sent_to_the_de_goes_there_whole_and_is_not_a_move(made, move):
    make, store = made
    reader = make(ACCEPTED, move=move, queued_tokens=0)  # an idle link: a PE-side read would stay here
    spec = dataclasses.replace(_spec(), read_side="de")
    assert reader.plan(spec) == ReadPlan(0, 10.0, routed=True)  # de_read_timeout_s, whatever this link's state

    hit = _submit(reader, spec)
    assert hit.remote is not None and hit.chunks == CHUNKS and store.whole_reads == []
    assert reader.peers.requests[0][2] == 10.0
    counted = reader.stats.take() or {}  # None: nothing counted
    assert counted.get("reads_moved_to_de", 0) == 0  # the router's choice, not this engine's
    # Control: the same read with the PE's read side stays here.
    assert reader.plan(_spec()).kind == "here"

# -- splitting one hit across both links ------------------------------------------------------

# CHUNKS: 3 chunks of 8 tokens (5 blocks of 4 tokens: the last chunk's first block is cached here).
TAIL_ACCEPTED = {"readable": 2, "lease": "lease-2", "chunk_addrs": [4096, 8192], "layer_stride": LAYOUT.layer_block_bytes,
                 "lease_s": 120.0}


def test_an_idle_link_reads_the_head_while_the_de_reads_the_tail(made):
    make, store = made
    reader = make(TAIL_ACCEPTED, queued_tokens=0, split_min_tokens=8)
    head, tail = _submit_parts(reader, _spec())

    # Head here (one chunk: about half of 20 tokens in chunks of 8), tail by the DE; each chunk read once.
    assert head.remote is None and head.chunks == CHUNKS[:1] and store.whole_reads == [[KEY_SPACE.key(HASHES[0])]]
    assert tail.remote is not None and tail.remote.lease == "lease-2" and tail.chunks == CHUNKS[1:]
    ((_, message, timeout_s),) = reader.peers.requests
    assert message["chunk_hashes"] == HASHES[1:]
    # The deadline is the whole read here: 20 tokens at 1000 tokens/s; the DE keeps the tail for its decode.
    assert timeout_s == pytest.approx(0.02) and message["keep_token"] == "ab" * 16
    counted = reader.stats.take()
    assert counted["split_read_tail_tokens"] == 12 and counted["reads_moved_to_de"] == 0
    reader.release([head, tail])


def test_a_declined_tail_is_read_here_after_the_head(made):
    make, store = made
    reader = make(PeerBusy("DE 10.0.0.2:5700 is busy"), queued_tokens=0, split_min_tokens=8)
    head, tail = _submit_parts(reader, _spec())

    assert head.chunks + tail.chunks == CHUNKS and head.remote is None and tail.remote is None
    keys = [KEY_SPACE.key(h) for h in HASHES]
    assert store.whole_reads == [keys[:1], keys[1:]]  # no chunk read twice
    assert reader.stats.take()["split_read_tail_tokens"] == 0
    reader.release([head, tail])


def test_a_short_head_ends_the_hit_and_hands_the_tail_back(made):
    make, store = made
    del store.objects[KEY_SPACE.key(HASHES[0])]  # evicted since the lookup
    reader = make(TAIL_ACCEPTED, queued_tokens=0, split_min_tokens=8)
    (head,) = _submit_parts(reader, _spec())

    # No hole in the hit: nothing after the missing chunk is used, and the DE's lease is released (it keeps
    # the tail under the token, for its own decode, where its hashes match).
    assert head.chunks == []
    assert reader.peers.notified == [RELEASE + b"lease-2"]


PLAN = {"num_chunks": 10, "chunk_tokens": 100, "tokens_per_s": 100.0, "max_deadline_s": 60.0}


@pytest.mark.parametrize(
    "case, options, expected",
    [
        # Both sides end together when this engine keeps (hit - queued) / 2.
        ("idle link: halved", {"hit_tokens": 1000, "queued_tokens": 0, "split_min_tokens": 100}, ReadPlan(5, 10.0)),
        ("short queue: less here", {"hit_tokens": 1000, "queued_tokens": 400, "split_min_tokens": 100},
         ReadPlan(3, 14.0)),
        ("queue past the hit: all moves", {"hit_tokens": 1000, "queued_tokens": 1000, "split_min_tokens": 100},
         ReadPlan(0, 20.0)),
        ("parts under the minimum: here", {"hit_tokens": 1000, "queued_tokens": 0, "split_min_tokens": 600},
         ReadPlan(10)),
        ("a small head under the minimum: all moves", {"hit_tokens": 1000, "queued_tokens": 800,
                                                        "split_min_tokens": 200}, ReadPlan(0, 18.0)),
        ("splitting off: an idle link reads here", {"hit_tokens": 1000, "queued_tokens": 0, "split_min_tokens": 0},
         ReadPlan(10)),
        ("splitting off: a busy link still moves", {"hit_tokens": 1000, "queued_tokens": 10, "split_min_tokens": 0},
         ReadPlan(0, 10.1)),
        ("no measured rate: here", {"hit_tokens": 1000, "queued_tokens": 400, "split_min_tokens": 100,
                                    "tokens_per_s": None}, ReadPlan(10)),
        ("the deadline is capped", {"hit_tokens": 1000, "queued_tokens": 9000, "split_min_tokens": 100,
                                    "max_deadline_s": 30.0}, ReadPlan(0, 30.0)),
        # moved_read_min_deadline_s: a least deadline where the estimate is shorter, still under the cap.
        ("a least deadline", {"hit_tokens": 1000, "queued_tokens": 0, "split_min_tokens": 100,
                              "min_deadline_s": 25.0, "max_deadline_s": 30.0}, ReadPlan(5, 25.0)),
        ("a least deadline past the estimate only", {"hit_tokens": 1000, "queued_tokens": 0, "split_min_tokens": 100,
                                                     "min_deadline_s": 4.0}, ReadPlan(5, 10.0)),
    ],
)  # fmt: skip
def test_plan_read(case, options, expected):
    assert plan_read(**{**PLAN, **options}) == expected, case


@pytest.mark.parametrize("recompute_s", [None, 5.0])
def test_a_read_here_carries_its_recompute_deadline_to_the_store(made, recompute_s):
    """The store sees the load's deadline (the hit's estimated recompute time from the submission), so its
    retries end by then; with no estimate yet there is none."""
    make, store = made
    reader = make(ACCEPTED, move=False)
    reader.recompute_s = lambda tokens: None if recompute_s is None else recompute_s
    seen, read = [], store.read
    store.read = lambda keys, dst_addrs: seen.append(seconds_left()) or read(keys, dst_addrs)
    hit = _submit(reader, _spec())
    assert hit.chunks == CHUNKS and len(seen) == 1
    assert seen[0] is None if recompute_s is None else 0 < seen[0] <= recompute_s
