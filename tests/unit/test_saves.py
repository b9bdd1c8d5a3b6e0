"""ChunkSaver's store write with ``only_missing`` (chunks recomputed after a failed load): the store's copies stay."""

from __future__ import annotations

from types import SimpleNamespace

from dualpath_connector.metadata import SaveSpec
from dualpath_connector.save.saves import ChunkSaver
from dualpath_connector.metrics.stats_recorder import StatsRecorder


class FakeStore:
    def __init__(self, present: set[str]) -> None:
        self.present = set(present)
        self.written: list[str] = []

    def lookup(self, keys):
        return 1 if keys[0] in self.present else 0

    def write(self, keys, addrs):
        self.written += keys
        return [True] * len(keys)


def _saver(store: FakeStore) -> SimpleNamespace:
    """What ``_write_keys`` uses of a ChunkSaver: the store, the stats and the pool's slot addresses."""
    return SimpleNamespace(store=store, stats=StatsRecorder(), pool=SimpleNamespace(slot_addr=lambda slot: 4096 * slot))


def test_only_missing_writes_the_chunks_the_store_lacks_and_counts_the_rest():
    store = FakeStore({"k0", "k2"})
    saver = _saver(store)
    ok, present = ChunkSaver._write_keys(saver, SaveSpec("r1", ["h0", "h1", "h2"], [[0], [1], [2]], only_missing=True),
                                         ["k0", "k1", "k2"], [5, 6, 7])  # fmt: skip
    assert (ok, present, store.written) == ([True, True, True], 2, ["k1"])
    assert saver.stats.take()["resave_present_chunks"] == 2


def test_a_plain_save_writes_every_chunk():
    """Negative control: without ``only_missing`` the same chunks are all written, present or not."""
    store = FakeStore({"k0", "k2"})
    ok, present = ChunkSaver._write_keys(_saver(store), SaveSpec("r1", ["h0", "h1", "h2"], [[0], [1], [2]]),
                                         ["k0", "k1", "k2"], [5, 6, 7])  # fmt: skip
    assert (ok, present, store.written) == ([True, True, True], 0, ["k0", "k1", "k2"])
