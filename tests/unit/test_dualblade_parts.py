"""The pure-Python parts of the Dual-Blade tier, without a NIXL agent or a store around them.

- BindMap: lowest-free-first allocation, release and unbind, the journal replayed on restart,
  torn and corrupt records, a shrunk capacity, lookup-only readers tailing the journal across
  compactions.
- plan_residency (Algorithm 1 with the ranker boost): n1, the leftover boost, layers_for, bad inputs.
- RecencyRanker: LRU order, coldest with skipped keys, remove.
- AdaptivePipeline: fixed modes, the warm-up read, the alternating trials, the median decision, retry.
- DualBladeStoreConfig and TieredStoreConfig parsing: every bad value is a ConfigError naming its key.
- ExtentFile on a real file under tmp_path: preallocation, hole punching, alignment helpers.

Journals and extent files live under tmp_path; nothing sleeps.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nixl_backends.configuration import ConfigError
from nixl_backends.dualblade.bind_map import BindMap, Binding
from nixl_backends.dualblade.config import DualBladeStoreConfig
from nixl_backends.buffers import ALIGNMENT, align_down, align_up
from nixl_backends.dualblade.extents import ExtentFile
from nixl_backends.dualblade.pipeline import AdaptivePipeline
from nixl_backends.dualblade.planner import ResidencyPlan, plan_ranked, plan_residency
from nixl_backends.dualblade.ranker import RANKERS, RecencyRanker
from nixl_backends.posix import PosixStoreConfig
from nixl_backends.registry import parse_store_config
from nixl_backends.tiered import TieredStoreConfig

# =================================================================================================
# BindMap
# =================================================================================================


@pytest.fixture
def journal(tmp_path: Path) -> str:
    return str(tmp_path / "bind.journal")


@pytest.fixture
def open_map(journal):
    """``open_map(num_extents, writer=True)``: a BindMap on the test's journal, closed at teardown."""
    opened: list[BindMap] = []

    def _open(num_extents: int = 16, writer: bool = True) -> BindMap:
        bind_map = BindMap(journal, num_extents, writer=writer)
        opened.append(bind_map)
        return bind_map

    yield _open
    for bind_map in opened:
        bind_map.close()


def _bind_new(bind_map: BindMap, keys: list[str]) -> dict[str, Binding]:
    """Allocate one extent per key and bind it (checksum derived from the extent, so every bind differs)."""
    extents = bind_map.allocate(len(keys))
    assert len(extents) == len(keys)
    entries = {key: Binding(extent, 1000 + extent) for key, extent in zip(keys, extents)}
    bind_map.bind(entries.items())
    return entries


def _churn(bind_map: BindMap, count: int, tag: str) -> None:
    """Bind then unbind ``count`` fresh keys: 2 * count journal records and no change in live binds."""
    keys = [f"{tag}-{i:05d}" for i in range(count)]
    _bind_new(bind_map, keys)
    bind_map.release(bind_map.unbind(keys))


def _journal_lines(journal: str) -> list[bytes]:
    """The journal's records, without the epoch line a writer starts it with."""
    with open(journal, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    return lines[1:] if lines and lines[0].startswith(b'["E",') else lines


# --- allocation ----------------------------------------------------------------------------------


def test_fresh_map_allocates_lowest_first_and_contiguous(open_map):
    bind_map = open_map(8)
    assert bind_map.free_extents == 8
    assert bind_map.allocate(3) == [0, 1, 2]
    assert bind_map.allocate(2) == [3, 4]
    assert bind_map.free_extents == 3


def test_allocate_returns_fewer_when_fewer_are_free(open_map):
    bind_map = open_map(4)
    assert bind_map.allocate(10) == [0, 1, 2, 3]
    assert bind_map.allocate(1) == []
    assert bind_map.free_extents == 0


def test_release_returns_extents_and_lowest_is_reused_first(open_map):
    bind_map = open_map(8)
    bind_map.allocate(6)  # 0..5
    bind_map.release([4, 1])
    assert bind_map.free_extents == 4  # 1, 4, 6, 7
    assert bind_map.allocate(3) == [1, 4, 6]


def test_unbind_returns_the_extents_of_bound_keys_only(open_map):
    bind_map = open_map(8)
    _bind_new(bind_map, ["a", "b", "c"])  # 0, 1, 2
    freed = bind_map.unbind(["b", "missing", "b", "a"])
    assert sorted(freed) == [0, 1]
    assert set(bind_map.bindings) == {"c"}
    bind_map.release(freed)
    assert bind_map.allocate(3) == [0, 1, 3]


def test_unbind_of_nothing_appends_nothing(open_map, journal):
    bind_map = open_map(4)
    _bind_new(bind_map, ["a"])
    size = os.path.getsize(journal)
    assert bind_map.unbind(["not-there"]) == []
    assert os.path.getsize(journal) == size


# --- restart -------------------------------------------------------------------------------------


def test_binds_are_replayed_by_a_new_writer(open_map):
    first = open_map(8)
    bound = _bind_new(first, ["a", "b", "c"])
    first.close()

    second = open_map(8)
    assert second.bindings == bound
    # Bound extents are not free after the restart; allocation continues after them.
    assert second.free_extents == 5
    assert second.allocate(2) == [3, 4]


def test_unbinds_survive_restart_and_free_their_extents(open_map):
    first = open_map(8)
    _bind_new(first, ["a", "b", "c"])  # 0, 1, 2
    first.release(first.unbind(["b"]))
    first.close()

    second = open_map(8)
    assert set(second.bindings) == {"a", "c"}
    assert second.bindings["a"] == Binding(0, 1000)
    assert second.bindings["c"] == Binding(2, 1002)
    assert second.allocate(2) == [1, 3]


def test_a_rebind_replays_as_the_last_binding_and_frees_the_old_extent(open_map):
    first = open_map(4)
    first.bind([("k", Binding(0, 1))])
    first.bind([("k", Binding(2, 3))])
    first.close()

    second = open_map(4)
    assert second.bindings == {"k": Binding(2, 3)}
    assert second.allocate(4) == [0, 1, 3]


def test_bind_beyond_a_shrunk_capacity_is_dropped_on_replay(open_map):
    first = open_map(8)
    first.bind([("low", Binding(1, 11)), ("high", Binding(6, 66))])
    first.close()

    shrunk = open_map(4)
    assert shrunk.bindings == {"low": Binding(1, 11)}
    assert shrunk.free_extents == 3
    assert shrunk.allocate(4) == [0, 2, 3]


# --- torn and corrupt journals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param(None, id="unterminated-half-line"),
        pytest.param(b'["B","torn",3,7]\t0000000000000000\n', id="bad-checksum-last-line"),
        pytest.param(b"not a record at all\n", id="garbage-last-line"),
    ],
)
def test_torn_last_line_is_dropped_and_truncated_so_later_appends_are_read(open_map, journal, tail):
    first = open_map(8)
    bound = _bind_new(first, ["a", "b"])
    first.close()
    good_size = os.path.getsize(journal)
    if tail is None:
        # The crash hit an append: the first half of a real record, no newline.
        probe = open_map(8)
        _bind_new(probe, ["torn"])
        probe.close()
        with open(journal, "r+b") as f:
            f.truncate(good_size + (os.path.getsize(journal) - good_size) // 2)
    else:
        with open(journal, "ab") as f:
            f.write(tail)
    assert os.path.getsize(journal) > good_size

    writer = open_map(8)
    assert writer.bindings == bound
    assert os.path.getsize(journal) == good_size  # the torn tail is cut off
    later = _bind_new(writer, ["c"])
    writer.close()

    reopened = open_map(8, writer=False)
    assert reopened.bindings == {**bound, **later}


def test_corrupt_middle_record_drops_it_and_everything_after(open_map, journal, caplog):
    """Chosen behaviour: replay stops at the first bad complete record; the records after it are
    not trusted (they may depend on it) and the writer truncates them away."""
    first = open_map(8)
    first.bind([("a", Binding(0, 10))])
    first.bind([("b", Binding(1, 11))])
    first.bind([("c", Binding(2, 12))])
    first.close()
    lines = _journal_lines(journal)
    assert len(lines) == 3
    # Flip the extent of b's record without fixing its checksum.
    lines[1] = lines[1].replace(b'"b",1,', b'"b",5,')
    with open(journal, "wb") as f:
        f.write(b"".join(lines))

    reader = open_map(8, writer=False)
    assert reader.bindings == {"a": Binding(0, 10)}
    assert "bad record" in caplog.text

    writer = open_map(8)
    assert writer.bindings == {"a": Binding(0, 10)}
    assert _journal_lines(journal) == lines[:1]
    # b's and c's extents are free again.
    assert writer.allocate(3) == [1, 2, 3]


def test_missing_journal_is_an_empty_map(open_map, journal):
    reader = open_map(4, writer=False)
    assert reader.bindings == {}
    assert not os.path.exists(journal)
    reader.refresh()
    assert reader.bindings == {}


# --- lookup-only readers -------------------------------------------------------------------------


def test_lookup_only_map_refuses_bind_and_unbind(open_map):
    writer = open_map(4)
    _bind_new(writer, ["a"])
    reader = open_map(4, writer=False)
    with pytest.raises(RuntimeError):
        reader.bind([("b", Binding(1, 1))])
    with pytest.raises(RuntimeError):
        reader.unbind(["a"])


def test_reader_sees_binds_and_frees_only_after_refresh(open_map):
    writer = open_map(8)
    _bind_new(writer, ["a", "b"])
    reader = open_map(8, writer=False)
    assert set(reader.bindings) == {"a", "b"}

    _bind_new(writer, ["c"])
    writer.release(writer.unbind(["a"]))
    assert set(reader.bindings) == {"a", "b"}  # not yet

    reader.refresh()
    assert reader.bindings == writer.bindings
    assert set(reader.bindings) == {"b", "c"}


def test_reader_opened_before_the_journal_exists_follows_it(open_map):
    reader = open_map(8, writer=False)
    writer = open_map(8)
    bound = _bind_new(writer, ["a", "b"])
    reader.refresh()
    assert reader.bindings == bound


def test_reader_waits_for_an_unterminated_line_to_complete(open_map, journal):
    writer = open_map(8)
    _bind_new(writer, ["a"])
    reader = open_map(8, writer=False)
    _bind_new(writer, ["b"])
    # Pretend the reader caught the append half-way: cut the last line, refresh, then restore it.
    with open(journal, "rb") as f:
        full = f.read()
    with open(journal, "r+b") as f:
        f.truncate(len(full) - 5)
    reader.refresh()
    assert set(reader.bindings) == {"a"}
    with open(journal, "r+b") as f:
        f.seek(len(full) - 5)
        f.write(full[-5:])
    reader.refresh()
    assert reader.bindings == writer.bindings


def _compact(writer: BindMap, journal: str, tag: str) -> None:
    """Churn whole bind-then-unbind batches until the writer compacts (the journal's inode changes).

    Each batch is completed before anything is checked, so the live binds are the same whichever
    append of the batch crossed the threshold (records > max(1024, 4 * live)).
    """
    inode = os.stat(journal).st_ino
    for round_ in range(5):
        _churn(writer, 600, f"{tag}{round_}")
        if os.stat(journal).st_ino != inode:
            return
    pytest.fail("the writer never compacted its journal")


def test_compaction_shrinks_the_journal_and_a_reader_follows_it(open_map, journal):
    writer = open_map(4096)
    _bind_new(writer, ["keep-1", "keep-2", "gone"])
    reader = open_map(4096, writer=False)
    assert set(reader.bindings) == {"keep-1", "keep-2", "gone"}
    writer.release(writer.unbind(["gone"]))
    _churn(writer, 400, "grow")  # 800 records: below the threshold
    size_before = os.path.getsize(journal)
    assert len(_journal_lines(journal)) == 804

    _compact(writer, journal, "churn")

    assert os.path.getsize(journal) < size_before
    # Appends after the compaction land in the new file and are read too.
    _bind_new(writer, ["after"])
    reader.refresh()  # the reader saw "gone" bound before the compaction
    assert reader.bindings == writer.bindings
    assert set(reader.bindings) == {"keep-1", "keep-2", "after"}

    # A restart replays the compacted journal to the same state, and the bound extents stay taken.
    writer.close()
    restarted = open_map(4096)
    assert restarted.bindings == reader.bindings
    taken = {b.extent for b in restarted.bindings.values()}
    assert not taken & set(restarted.allocate(4096))


def test_no_compaction_below_the_minimum_record_count(open_map, journal):
    writer = open_map(2048)
    _churn(writer, 500, "x")  # 1000 records, 0 live: below _MIN_COMPACT = 1024
    assert len(_journal_lines(journal)) == 1000


@pytest.mark.parametrize("trigger", ["bind", "unbind"])
def test_the_call_that_triggers_compaction_is_kept_in_the_journal(open_map, journal, monkeypatch, trigger):
    """The snapshot holds the state *after* the call whose records crossed the threshold: its binds
    are in it, its frees are not (else a restart would bind extents the writer already reused)."""
    monkeypatch.setattr("nixl_backends.dualblade.bind_map._MIN_COMPACT", 8)
    writer = open_map(64)
    # Records are counted with the epoch line; the threshold is max(8, 4 * live) after each call.
    if trigger == "bind":
        _bind_new(writer, ["x", "y"])  # 3 records, 2 live
        writer.release(writer.unbind(["x", "y"]))  # 5, 0 live
        _bind_new(writer, ["z"])  # 6, 1 live
        writer.release(writer.unbind(["z"]))  # 7, 0 live
        _bind_new(writer, ["w"])  # 8, 1 live: not over 8
        _bind_new(writer, ["v"])  # 9, 2 live: over max(8, 8), so this bind compacts
    else:
        _bind_new(writer, ["w", "v"])  # 3, 2 live
        _bind_new(writer, [f"y{i}" for i in range(8)])  # 11, 10 live
        writer.release(writer.unbind([f"y{i}" for i in range(8)]))  # 19, 2 live: this unbind compacts
    assert set(writer.bindings) == {"w", "v"}
    assert len(_journal_lines(journal)) == 2  # the snapshot: exactly the live binds
    assert open_map(64, writer=False).bindings == writer.bindings
    expected = dict(writer.bindings)
    writer.close()
    assert open_map(64).bindings == expected


def test_compaction_follows_a_large_unbind(open_map, journal):
    writer = open_map(4096)
    _bind_new(writer, ["keep-1", "keep-2"])
    keys = [f"k{i:04d}" for i in range(600)]
    _bind_new(writer, keys)  # 602 records, 602 live: no compaction
    writer.release(writer.unbind(keys))  # 1202 records, 2 live
    assert len(_journal_lines(journal)) == 2


def test_reader_follows_a_compaction_that_reuses_the_inode_number(open_map, journal, monkeypatch):
    """Every generation of the journal reports the same inode number here. On ext4 two compactions
    can really produce that (the first deletes the reader's file, the second's new file takes its
    number), but not predictably, so the file system's answer is pinned."""
    real_fstat = os.fstat
    journal_path = os.path.realpath(journal)

    def fstat(fd):
        result = real_fstat(fd)
        try:
            is_journal = os.readlink(f"/proc/self/fd/{fd}") == journal_path
        except OSError:
            is_journal = False
        if not is_journal:
            return result
        fields = list(result[:10])
        fields[1] = 4242  # st_ino
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", fstat)
    writer = open_map(4096)
    writer.bind([("a", Binding(0, 10)), ("b", Binding(1, 11))])
    reader = open_map(4096, writer=False)
    assert set(reader.bindings) == {"a", "b"}

    writer.release(writer.unbind(["b"]))
    _compact(writer, journal, "churn")
    # The journal now replays to {"a"}; a bind as long as b's was ends right at the reader's old offset.
    assert BindMap(journal, 4096, writer=False).bindings == {"a": Binding(0, 10)}
    writer.bind([("c", Binding(1, 11))])

    reader.refresh()
    assert reader.bindings == writer.bindings == {"a": Binding(0, 10), "c": Binding(1, 11)}


# =================================================================================================
# plan_residency
# =================================================================================================

HOT = [f"k{i}" for i in range(10)]  # hottest first


@pytest.mark.parametrize(
    "X,N,S,L,n1,boost",
    [
        (0, 4, 100, 8, 0, 0),  # no budget: everything direct
        (399, 4, 100, 8, 0, 3),  # less than one layer per chunk: the 3 hottest get layer 0
        (400, 4, 100, 8, 1, 0),
        (1000, 4, 100, 8, 2, 2),  # 800 for 2 layers everywhere, 200 left: 2 hottest get a third
        (1099, 4, 100, 8, 2, 2),  # 299 left: still 2 (floor)
        (3199, 4, 100, 8, 7, 3),
        (3200, 4, 100, 8, 8, 0),  # exactly every layer of every chunk
        (10**15, 4, 100, 8, 8, 0),  # huge: n1 = L, nothing to boost
        (250, 0, 100, 8, 2, 0),  # N = 0 counts as one chunk
        (10**15, 0, 100, 3, 3, 0),
        (7 * 512, 7, 512, 1, 1, 0),
        (7 * 512 - 1, 7, 512, 1, 0, 6),
    ],
)
def test_plan_n1_and_boost_count(X, N, S, L, n1, boost):
    plan = plan_residency(X, S, L, N, iter(HOT))
    assert plan.knob_bytes == X
    assert plan.page_cache_layers == n1
    assert plan.boosted == frozenset(HOT[:boost])
    # Never over budget, and (with enough hot keys) less than one layer block of it idles.
    chunks = max(N, 1)
    used = (n1 * chunks + boost) * S
    assert used <= X
    assert n1 == L or X - used < S


def test_boost_follows_the_rankers_order_not_the_names():
    order = ["zeta", "alpha", "mid", "beta"]
    plan = plan_residency(1000, 100, 8, 4, order)  # n1 = 2, leftover 200: two boosted
    assert plan.boosted == {"zeta", "alpha"}


def test_boost_is_limited_by_the_keys_the_ranker_names():
    plan = plan_residency(399, 100, 8, 4, ["only"])
    assert plan.page_cache_layers == 0
    assert plan.boosted == {"only"}


def test_plan_does_not_consume_more_of_the_ranking_than_it_boosts():
    seen = []

    def ranking():
        for key in HOT:
            seen.append(key)
            yield key

    plan_residency(1000, 100, 8, 4, ranking())
    assert seen == HOT[:2]


def test_layers_for_is_n1_or_n1_plus_one():
    plan = plan_residency(1000, 100, 8, 4, ["hot", "warm", "cold", "colder"])
    assert plan.layers_for("hot") == 3
    assert plan.layers_for("warm") == 3
    assert plan.layers_for("cold") == 2
    assert plan.layers_for("never-seen") == 2
    full = plan_residency(10**12, 100, 8, 4, ["hot"])
    assert full.layers_for("hot") == full.layers_for("other") == 8


def test_plan_with_the_recency_ranker():
    ranker = RecencyRanker()
    for key in ["a", "b", "c", "d"]:
        ranker.touch(key)
    ranker.touch("a")
    plan = plan_residency(450, 100, 4, 4, ranker.hottest_first())  # n1 = 1, leftover 50: none boosted
    assert (plan.page_cache_layers, plan.boosted) == (1, frozenset())
    plan = plan_residency(650, 100, 4, 4, ranker.hottest_first())  # n1 = 1, leftover 250: two boosted
    assert plan.boosted == {"a", "d"}


def test_default_plan_has_no_boost():
    assert ResidencyPlan(0, 3).layers_for("x") == 3


@pytest.mark.parametrize(
    "X,S,L", [(-1, 100, 8), (100, 0, 8), (100, -5, 8), (100, 100, 0), (100, 100, -1)]
)
def test_plan_rejects_bad_inputs(X, S, L):
    with pytest.raises(ValueError):
        plan_residency(X, S, L, 4, HOT)


# =================================================================================================
# RecencyRanker
# =================================================================================================


def test_ranker_registry_names_recency():
    assert RANKERS["recency"] is RecencyRanker


@pytest.mark.parametrize("knob,whole", [(0, 0), (8 * 100 - 1, 0), (8 * 100, 1), (8 * 100 * 3 + 799, 3), (8 * 100 * 50, 5)])
def test_plan_ranked_caches_whole_chunks_hottest_first(knob, whole):
    hottest = ["h0", "h1", "h2", "h3", "h4"]
    plan = plan_ranked(knob, 100, 8, iter(hottest))
    assert plan.boosted == frozenset(hottest[:whole]) and plan.page_cache_layers == 0
    assert [plan.layers_for(key) for key in hottest] == [8] * whole + [0] * (5 - whole)


def test_plan_ranked_rejects_a_negative_knob():
    with pytest.raises(ValueError):
        plan_ranked(-1, 100, 8, [])


def test_recency_order_follows_touches():
    ranker = RecencyRanker()
    for key in ["a", "b", "c"]:
        ranker.touch(key)
    assert list(ranker.hottest_first()) == ["c", "b", "a"]
    ranker.touch("a")
    assert list(ranker.hottest_first()) == ["a", "c", "b"]
    ranker.touch("a")  # touching the hottest again changes nothing
    assert list(ranker.hottest_first()) == ["a", "c", "b"]


def test_coldest_skips_keys():
    ranker = RecencyRanker()
    for key in ["a", "b", "c"]:
        ranker.touch(key)
    assert ranker.coldest(()) == "a"
    assert ranker.coldest({"a"}) == "b"
    assert ranker.coldest({"a", "b"}) == "c"
    assert ranker.coldest({"a", "b", "c"}) is None
    assert RecencyRanker().coldest(()) is None


def test_remove_drops_a_key_and_tolerates_absent_ones():
    ranker = RecencyRanker()
    for key in ["a", "b", "c"]:
        ranker.touch(key)
    ranker.remove("a")
    ranker.remove("never-there")
    assert list(ranker.hottest_first()) == ["c", "b"]
    assert ranker.coldest(()) == "b"
    ranker.touch("a")  # a returning key is hottest
    assert list(ranker.hottest_first()) == ["a", "c", "b"]


# =================================================================================================
# AdaptivePipeline
# =================================================================================================

MB = 1_000_000


def _run(pipeline: AdaptivePipeline, seconds_for: dict[str, float], reads: int) -> list[str]:
    """``reads`` reads of 1 MB, each taking ``seconds_for[strategy]``; the strategies used, in order."""
    used = []
    for _ in range(reads):
        strategy = pipeline.next_strategy()
        used.append(strategy)
        pipeline.record(strategy, MB, seconds_for[strategy])
    return used


@pytest.mark.parametrize("mode", ["intra", "cross"])
def test_fixed_mode_always_returns_its_strategy(mode):
    pipeline = AdaptivePipeline(mode)
    # Even when the other strategy would measure faster.
    assert _run(pipeline, {"intra": 1.0, "cross": 1.0}, 10) == [mode] * 10
    pipeline.record("cross" if mode == "intra" else "intra", MB, 1e-6)
    pipeline.retry()
    assert pipeline.next_strategy() == mode


@pytest.mark.parametrize("faster,slower", [("intra", "cross"), ("cross", "intra")])
def test_adaptive_warms_up_alternates_then_keeps_the_faster(faster, slower):
    pipeline = AdaptivePipeline("adaptive", trial_rounds=3)
    used = _run(pipeline, {faster: 0.001, slower: 0.004}, 7)
    # Warm-up, then intra, cross, intra, cross, intra, cross.
    assert used == ["intra", "intra", "cross", "intra", "cross", "intra", "cross"]
    assert pipeline.chosen == faster
    assert _run(pipeline, {faster: 0.001, slower: 0.004}, 5) == [faster] * 5


def test_adaptive_decides_only_after_trial_rounds_of_each():
    pipeline = AdaptivePipeline("adaptive", trial_rounds=2)
    _run(pipeline, {"intra": 0.001, "cross": 0.002}, 4)  # warm-up + intra, cross, intra
    assert pipeline.chosen is None
    assert pipeline.next_strategy() == "cross"
    _run(pipeline, {"intra": 0.001, "cross": 0.002}, 1)
    assert pipeline.chosen == "intra"


def test_warm_up_read_is_not_measured():
    pipeline = AdaptivePipeline("adaptive", trial_rounds=1)
    assert pipeline.next_strategy() == "intra"
    pipeline.record("intra", MB, 1e-6)  # a blazing warm-up; counting it would make intra win
    pipeline.record("intra", MB, 0.010)
    pipeline.record("cross", MB, 0.005)
    assert pipeline.chosen == "cross"


def test_decision_uses_the_median_not_the_mean():
    pipeline = AdaptivePipeline("adaptive", trial_rounds=3)
    pipeline.record("intra", MB, 1.0)  # warm-up
    # intra: one outlier-fast read, two slow ones; cross: steadily medium.
    for intra_s, cross_s in [(1e-6, 0.002), (0.004, 0.002), (0.004, 0.002)]:
        pipeline.record("intra", MB, intra_s)
        pipeline.record("cross", MB, cross_s)
    assert pipeline.chosen == "cross"


def test_retry_starts_the_trials_again():
    pipeline = AdaptivePipeline("adaptive", trial_rounds=2)
    _run(pipeline, {"intra": 0.001, "cross": 0.003}, 5)
    assert pipeline.chosen == "intra"
    pipeline.retry()
    assert pipeline.chosen is None
    # A fresh warm-up and fresh trials: the old intra rates must not count.
    used = _run(pipeline, {"intra": 0.003, "cross": 0.001}, 5)
    assert used == ["intra", "intra", "cross", "intra", "cross"]
    assert pipeline.chosen == "cross"


@pytest.mark.parametrize("mode,rounds", [("fast", 2), ("", 2), ("adaptive", 0), ("intra", -1)])
def test_bad_pipeline_arguments_raise(mode, rounds):
    with pytest.raises(ValueError):
        AdaptivePipeline(mode, trial_rounds=rounds)


# =================================================================================================
# Config
# =================================================================================================


def _dualblade(tmp_path: Path, **overrides) -> dict:
    data = {"backend": "dualblade", "root": str(tmp_path / "db")}
    data.update(overrides)
    return data


def _posix(tmp_path: Path, **overrides) -> dict:
    data = {"backend": "posix", "root": str(tmp_path / "px")}
    data.update(overrides)
    return data


def _config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_store_config(data)
    return str(info.value)


def test_dualblade_section_parses_with_defaults(tmp_path):
    config = parse_store_config(_dualblade(tmp_path))
    assert isinstance(config, DualBladeStoreConfig)
    assert config.root == str(tmp_path / "db")
    assert config.capacity_bytes == 8 << 30
    assert config.page_cache_bytes is None
    assert (config.reserve_bytes, config.ranker, config.pipeline) == (0, "recency", "adaptive")
    assert (config.replan_interval_s, config.io_timeout_s) == (1.0, 30.0)


def test_dualblade_section_accepts_edge_values(tmp_path):
    config = parse_store_config(_dualblade(
        tmp_path, capacity_bytes=1, page_cache_bytes=0, reserve_bytes=0, replan_interval_s=0,
        pipeline="cross", device="/dev/null-ish", io_engine="uring"))
    assert (config.capacity_bytes, config.page_cache_bytes, config.replan_interval_s) == (1, 0, 0)
    assert config.pipeline == "cross"


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"capacity_bytes": -4096}, "capacity_bytes"),
        ({"page_cache_bytes": -1}, "page_cache_bytes"),
        ({"reserve_bytes": -1}, "reserve_bytes"),
        ({"ranker": "nope"}, "ranker"),
        ({"replan_interval_s": -1}, "replan_interval_s"),
        ({"io_timeout_s": 0}, "io_timeout_s"),
        ({"root": ""}, "root"),
        ({"pipeline": "fast"}, "pipeline"),
        ({"residency": "mixed"}, "residency"),
        ({"page_cache_headroom": 1.0}, "page_cache_headroom"),
        ({"page_cache_headroom": -0.1}, "page_cache_headroom"),
        ({"capacity_bytes": "8G"}, "capacity_bytes"),
        ({"capacityy_bytes": 1}, "capacityy_bytes"),
    ],
)
def test_dualblade_bad_value_names_its_key(tmp_path, overrides, key):
    message = _config_error(_dualblade(tmp_path, **overrides))
    assert key in message
    assert "store." in message


def test_dualblade_unknown_key_is_called_unknown(tmp_path):
    message = _config_error(_dualblade(tmp_path, bogus=1))
    assert "unknown" in message and "store.'bogus'" in message


def test_dualblade_missing_root_is_named():
    message = _config_error({"backend": "dualblade"})
    assert "missing" in message and "'root'" in message


def test_ranker_error_lists_the_choices(tmp_path):
    message = _config_error(_dualblade(tmp_path, ranker="nope"))
    assert "'nope'" in message and "recency" in message


def test_tiered_section_parses_its_tiers(tmp_path):
    config = parse_store_config({"backend": "tiered", "tiers": [_dualblade(tmp_path), _posix(tmp_path)]})
    assert isinstance(config, TieredStoreConfig)
    assert [type(t) for t in config.tier_configs] == [DualBladeStoreConfig, PosixStoreConfig]


@pytest.mark.parametrize("tiers", [[], "one-tier"])
def test_tiered_needs_at_least_two_tiers(tmp_path, tiers):
    tiers = [_dualblade(tmp_path)] if tiers == "one-tier" else tiers
    message = _config_error({"backend": "tiered", "tiers": tiers})
    assert "store.tiers" in message


def test_tiered_tier_cannot_be_tiered(tmp_path):
    inner = {"backend": "tiered", "tiers": [_dualblade(tmp_path), _posix(tmp_path)]}
    message = _config_error({"backend": "tiered", "tiers": [_dualblade(tmp_path), inner]})
    assert "store.tiers" in message and "tiered" in message


def test_tiered_unknown_key_inside_a_tier_names_its_path(tmp_path):
    message = _config_error({"backend": "tiered", "tiers": [_dualblade(tmp_path), _posix(tmp_path, bogus=1)]})
    assert "store.tiers[1].'bogus'" in message


def test_tiered_wrong_type_inside_a_tier_names_its_path(tmp_path):
    message = _config_error(
        {"backend": "tiered", "tiers": [_dualblade(tmp_path), _posix(tmp_path, io_timeout_s="30")]})
    assert "store.tiers[1].'io_timeout_s'" in message


def test_tiered_bad_backend_inside_a_tier_names_its_path(tmp_path):
    message = _config_error({"backend": "tiered", "tiers": [_dualblade(tmp_path), {"backend": "nfs"}]})
    assert "store.tiers[1]." in message and "backend" in message


def test_tiered_bad_value_inside_a_tier_names_its_path(tmp_path):
    message = _config_error(
        {"backend": "tiered", "tiers": [_posix(tmp_path), _dualblade(tmp_path, capacity_bytes=0)]})
    assert "capacity_bytes" in message
    assert "store.tiers[1]." in message


# =================================================================================================
# ExtentFile
# =================================================================================================

EXTENT = 16 * ALIGNMENT  # 64 KiB


@pytest.fixture
def extent_file(tmp_path: Path):
    extents = ExtentFile(str(tmp_path / "extents"), 8 * EXTENT)
    yield extents
    extents.close()


def test_align_helpers():
    assert [align_up(v) for v in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]
    assert [align_down(v) for v in (0, 1, 4095, 4096, 8191, 8192)] == [0, 0, 0, 4096, 4096, 8192]


def test_new_extent_file_is_preallocated_to_capacity(extent_file):
    assert not extent_file.is_device
    assert extent_file.capacity == 8 * EXTENT
    assert os.path.getsize(extent_file.path) == 8 * EXTENT
    assert extent_file.allocated_bytes() >= 8 * EXTENT  # blocks exist before the first write


def test_existing_larger_file_is_cut_to_capacity(tmp_path):
    path = str(tmp_path / "extents")
    with open(path, "wb") as f:
        f.truncate(20 * EXTENT)
    extents = ExtentFile(path, 4 * EXTENT)
    try:
        assert extents.capacity == 4 * EXTENT
        assert os.path.getsize(path) == 4 * EXTENT
    finally:
        extents.close()


def test_discard_punches_one_extent_and_leaves_its_neighbours(extent_file):
    fd = extent_file.buffered_fd
    for index in range(3):
        os.pwrite(fd, bytes([index + 1]) * EXTENT, index * EXTENT)
    extent_file.sync()
    before = extent_file.allocated_bytes()

    extent_file.discard(1 * EXTENT, EXTENT)

    assert extent_file.allocated_bytes() <= before - EXTENT
    assert os.path.getsize(extent_file.path) == 8 * EXTENT  # the size is kept
    assert os.pread(fd, EXTENT, 0) == b"\x01" * EXTENT
    assert os.pread(fd, EXTENT, EXTENT) == b"\0" * EXTENT
    assert os.pread(fd, EXTENT, 2 * EXTENT) == b"\x03" * EXTENT


def test_drop_cached_keeps_the_bytes(extent_file):
    os.pwrite(extent_file.buffered_fd, b"\x07" * EXTENT, 0)
    extent_file.sync()
    extent_file.drop_cached(0, EXTENT)
    extent_file.drop_cached(0, extent_file.capacity)
    assert os.pread(extent_file.buffered_fd, EXTENT, 0) == b"\x07" * EXTENT


def test_root_placeholders_give_each_rank_its_own_root(tmp_path):
    from nixl_backends.registry import for_rank

    tiered = parse_store_config({"backend": "tiered", "tiers": [
        _dualblade(tmp_path, root=str(tmp_path / "tier-tp{tp_rank}-pp{pp_rank}")), _posix(tmp_path)]})
    local, shared = for_rank(tiered, 3, 1).tier_configs
    assert local.root == str(tmp_path / "tier-tp3-pp1") and shared == tiered.tier_configs[1]
    assert tiered.tier_configs[0].root.endswith("tier-tp{tp_rank}-pp{pp_rank}")  # the parsed section is unchanged
    assert for_rank(shared, 3, 1) is shared  # stores without per-rank parts are opened as they are


def test_a_router_looks_tiered_chunks_up_in_the_shared_tier(tmp_path):
    from nixl_backends.registry import shared_tier

    tiered = parse_store_config({"backend": "tiered", "tiers": [_dualblade(tmp_path), _posix(tmp_path)]})
    assert shared_tier(tiered) is tiered.tier_configs[1]
    assert shared_tier(tiered.tier_configs[1]) is tiered.tier_configs[1]


@pytest.mark.parametrize("root", ["/nvme/{rank}", "/nvme/{0}", "/nvme/{tp_rank"])
def test_root_with_another_placeholder_is_refused(tmp_path, root):
    assert "store.root" in _config_error(_dualblade(tmp_path, root=root))
