"""Store writes that end after the last request: the engine keeps stepping until they are counted.

vLLM hands a connector's stats and worker metadata to the scheduler only with an engine step, and an idle
engine does not step. So the scheduler half counts the writes it planned (``has_pending_push_work``) until
the workers report them finished (``SavedChunks.writes``), and a worker counts a write only in a stats
hand-over that already carries its stats. Driven here the way vLLM drives the two halves, without an engine.
"""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

from dualpath_connector.config import ChunkGeometry, parse_config
from dualpath_connector.metadata import SavedChunks, SaveSpec
from dualpath_connector.save.saves import ChunkSaver
from dualpath_connector.scheduler.scheduler import WRITES_DRAIN_GIVE_UP_S, DualPathScheduler
from dualpath_connector.metrics.stats_recorder import StatsRecorder
from dualpath_connector.worker.worker import DualPathWorker
from tests.unit.test_kv_events import prompt_of, save_all, vllm_request
from tests.unit.test_scheduler import BLOCK, CHUNK, KEY_PREFIX, NAMESPACE, FakeStore, InlineExecutor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scheduler_of(tmp_path, world_size: int, clock: Clock) -> DualPathScheduler:
    """A scheduler half without KV events: the count must not depend on them."""
    raw = {"store": {"backend": "posix", "root": str(tmp_path)}, "key_prefix": KEY_PREFIX}
    shards = [dataclasses.replace(NAMESPACE, tp_rank=rank) for rank in range(world_size)]
    return DualPathScheduler(parse_config(raw), "kv_both", ChunkGeometry(block_size=BLOCK, chunk_tokens=CHUNK),
                             shards[0], FakeStore(), shards=shards, lookup_executor=InlineExecutor(),
                             clock=clock)  # fmt: skip


def test_the_engine_keeps_stepping_until_every_rank_reported_its_write(tmp_path):
    scheduler = scheduler_of(tmp_path, world_size=2, clock=Clock())
    assert not scheduler.has_pending_push_work()
    assert len(save_all(scheduler, vllm_request("r1", prompt_of(2 * CHUNK)))) == 2  # one SaveSpec, two chunks
    assert scheduler.has_pending_push_work()
    scheduler.saves_finished(None)  # a step with nothing finished
    assert scheduler.has_pending_push_work()
    scheduler.saves_finished(SavedChunks(writes=1))  # one rank of two
    assert scheduler.has_pending_push_work()
    scheduler.saves_finished(SavedChunks(failed={"f" * 64}).aggregate(SavedChunks(writes=1)))  # a failed write ends too
    assert not scheduler.has_pending_push_work()


def test_a_write_never_reported_stops_holding_the_engine_after_the_give_up_time(tmp_path):
    clock = Clock()
    scheduler = scheduler_of(tmp_path, world_size=1, clock=clock)
    save_all(scheduler, vllm_request("r1", prompt_of(2 * CHUNK)))
    clock.now += WRITES_DRAIN_GIVE_UP_S - 1
    assert scheduler.has_pending_push_work()
    clock.now += 2
    assert not scheduler.has_pending_push_work()


def _fake_saver(events: list) -> SimpleNamespace:
    """What ``ChunkSaver._write`` uses; ``_written`` records the stats recorded by the time it is told."""
    saver = SimpleNamespace(
        key_space=SimpleNamespace(key=lambda h: f"k/{h}", object_hash=lambda h: h,
                                  layout=SimpleNamespace(full_block_bytes=64)),  # fmt: skip
        integrity=SimpleNamespace(seal=lambda object_hash, view: None),
        pool=SimpleNamespace(slot_view=lambda slot: None, release=lambda slots: None),
        stats=StatsRecorder(),
    )
    saver._write_keys = lambda spec, keys, slots: ([True] * len(keys), 0)
    saver._written = lambda spec, ok: events.append(saver.stats.take())
    return saver


def test_a_write_records_its_stats_before_it_tells_that_it_ended():
    events: list = []
    ChunkSaver._write(_fake_saver(events), SaveSpec("r1", ["h0", "h1"], [[0], [1]]), [3, 4], None)
    (stats,) = events
    assert stats["saved_chunks"] == 2 and stats["bytes_written"] == 128 and len(stats["save_seconds"]) == 1


def _fake_worker() -> SimpleNamespace:
    """What the worker's stats hand-over and write notes use."""
    return SimpleNamespace(peers=None, _add_store_metrics=lambda: None, _lock=threading.Lock(), _kv_events=False,
                           _writes_finished=0, _write_ended=threading.Event(), _saved=SavedChunks(),
                           stats=StatsRecorder())  # fmt: skip


def test_a_finished_write_is_reported_with_the_step_whose_stats_carry_it():
    worker = _fake_worker()
    worker.stats.add(saved_chunks=2)
    DualPathWorker._note_written(worker, ["h0", "h1"], [True, True])
    assert worker._write_ended.is_set()  # an empty step waiting for it returns now
    # vLLM takes the stats first, then the worker metadata.
    stats = DualPathWorker.get_stats(worker)
    assert stats.data["saved_chunks"] == 2
    assert DualPathWorker.take_saved_chunks(worker).writes == 1
    assert DualPathWorker.take_saved_chunks(worker) is None


def test_a_write_ending_between_the_stats_and_the_metadata_waits_for_the_next_step():
    """Its stats were recorded after this step's were taken: counting it now would let the engine go idle first."""
    worker = _fake_worker()
    assert DualPathWorker.get_stats(worker) is None
    worker.stats.add(saved_chunks=1)
    DualPathWorker._note_written(worker, ["h0"], [True])
    assert DualPathWorker.take_saved_chunks(worker) is None
    assert DualPathWorker.get_stats(worker).data["saved_chunks"] == 1
    assert DualPathWorker.take_saved_chunks(worker).writes == 1
