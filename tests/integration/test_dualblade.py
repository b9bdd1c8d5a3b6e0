"""The Dual-Blade tier and the tiered store through a real NIXL agent (POSIX backend, O_DIRECT on this disk).

Round trips on every path split, eviction by the ranker, TRIM, restart from
the journal, crash safety (a writer killed mid-run, a crash between the data
and its bind, a torn journal record), on-disk corruption as a miss (and, in
a tiered store, a read from the next tier), the page-cache budget's effect on
residency, and the tiered store's lookups, fills and write-through.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nixl_backends.buffers import HostBufferPool
from nixl_backends.configuration import ConfigError
from nixl_backends.dualblade.bind_map import BindMap
from nixl_backends.dualblade.extents import ExtentFile
from nixl_backends.dualblade.store import EXTENTS, JOURNAL
from nixl_backends.layout import BlockLayout
from nixl_backends.registry import make_store, parse_store_config

# 8 layers of 12 KiB: layer boundaries fall on and between 4 KiB pages, and the object (with its
# 128-byte trailer) is not a page multiple, so every split has an unaligned tail.
LAYOUT = BlockLayout(num_layers=8, layer_block_bytes=12 * 1024)
EXTENT = -(-LAYOUT.object_bytes // 4096) * 4096
KEYS = [f"ns/{i:02x}/chunk-{i}" for i in range(16)]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def expected(key: str) -> np.ndarray:
    """The object a key's chunk holds in these tests (so a reader can check bytes without the writer)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, LAYOUT.object_bytes, dtype=np.uint8)


def config(root, **extra) -> object:
    return parse_store_config({"backend": "dualblade", "root": str(root), "capacity_bytes": 8 * EXTENT, **extra})


@pytest.fixture
def pools(nixl_agent):
    made = []

    def make(slots: int = 8) -> HostBufferPool:
        made.append(HostBufferPool(nixl_agent, LAYOUT.object_bytes, slots))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


@pytest.fixture
def opened(nixl_agent):
    stores = []

    def make(cfg):
        stores.append(make_store(cfg, LAYOUT, nixl_agent))
        return stores[-1]

    yield make
    for store in reversed(stores):
        store.close()


def fill(pool: HostBufferPool, keys: list[str]) -> list[int]:
    for slot, key in enumerate(keys):
        pool.slot_view(slot)[:] = expected(key)
    return [pool.slot_addr(slot) for slot in range(len(keys))]


def read_back(store, pool: HostBufferPool, keys: list[str]) -> list[bool]:
    """Read into poisoned slots; True where the read said so *and* the bytes are the key's."""
    for slot in range(len(keys)):
        pool.slot_view(slot)[:] = 0xA5
    flags = store.read(keys, [pool.slot_addr(s) for s in range(len(keys))])
    return [flag and bool((pool.slot_view(s) == expected(k)).all()) for s, (k, flag) in enumerate(zip(keys, flags))]


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("knob,direct_expected", [(0, True), (3 * 8 * 12 * 1024, True), (None, False)])
def test_round_trip_on_every_split(tmp_path, opened, pools, knob, direct_expected):
    """X=0: direct only; X for 3 layers of all 8 extents: front layers cached, the rest direct; X=budget: all cached."""
    store = opened(config(tmp_path, page_cache_bytes=knob))
    src, dst = pools(), pools()
    if knob:
        assert store.plan.page_cache_layers == (3 if knob == 3 * 8 * 12 * 1024 else LAYOUT.num_layers)
    assert store.write(KEYS[:4], fill(src, KEYS[:4])) == [True] * 4
    assert read_back(store, dst, KEYS[:4]) == [True] * 4
    counters = store.metrics().counters
    assert (counters["local_tier_direct_bytes_read"] > 0) == direct_expected
    assert counters["local_tier_page_cache_bytes_read"] > 0  # the unaligned tail always takes the page cache
    assert counters["local_tier_hit_chunks"] == 4


def test_unaligned_memory_takes_the_page_cache_path(tmp_path, opened, nixl_agent):
    store = opened(config(tmp_path, page_cache_bytes=0))
    raw = np.zeros(LAYOUT.object_bytes + 8192, dtype=np.uint8)
    region = nixl_agent.register_memory([(raw.ctypes.data, raw.nbytes, 0, "")], "DRAM")
    try:
        offset = (-raw.ctypes.data) % 4096 + 100  # deliberately 100 bytes past a page boundary
        view = raw[offset : offset + LAYOUT.object_bytes]
        view[:] = expected(KEYS[0])
        assert store.write(KEYS[:1], [view.ctypes.data]) == [True]
        view[:] = 0
        assert store.read(KEYS[:1], [view.ctypes.data]) == [True]
        assert (view == expected(KEYS[0])).all()
        assert store.metrics().counters["local_tier_direct_bytes_read"] == 0
    finally:
        nixl_agent.deregister_memory(region)


def test_missing_keys_are_misses_and_lookup_is_a_leading_run(tmp_path, opened, pools):
    store = opened(config(tmp_path))
    src, dst = pools(), pools()
    store.write([KEYS[0], KEYS[2]], fill(src, [KEYS[0], KEYS[2]]))
    assert store.lookup(KEYS[:3]) == 1
    assert read_back(store, dst, KEYS[:3]) == [True, False, True]
    assert store.metrics().counters["local_tier_miss_chunks"] == 1


# -- capacity -------------------------------------------------------------------------------------


def test_a_full_tier_evicts_the_coldest_and_trims(tmp_path, opened, pools):
    store = opened(config(tmp_path))  # 8 extents
    src, dst = pools(16), pools()
    store.write(KEYS[:8], fill(src, KEYS[:8]))
    assert read_back(store, dst, KEYS[:2]) == [True, True]  # 0 and 1 become the hottest
    assert store.write(KEYS[8:11], fill(src, KEYS[8:11])) == [True] * 3
    resident = [key for key in KEYS[:11] if store.lookup([key])]
    assert resident == KEYS[:2] + KEYS[5:11]  # 2, 3, 4 were the coldest
    assert store.metrics().counters["local_tier_evicted_chunks"] == 3
    allocated = os.stat(tmp_path / EXTENTS).st_blocks
    store.delete(KEYS[:2])
    assert os.stat(tmp_path / EXTENTS).st_blocks < allocated  # holes punched (TRIM)
    assert store.lookup(KEYS[:1]) == 0
    assert store.metrics().gauges["local_tier_capacity_bytes"] == 8 * EXTENT


def test_a_capacity_below_one_chunk_is_refused_naming_the_key(tmp_path, nixl_agent):
    with pytest.raises(ConfigError, match="store.capacity_bytes"):
        make_store(parse_store_config({"backend": "dualblade", "root": str(tmp_path), "capacity_bytes": 4096}),
                   LAYOUT, nixl_agent)


def test_a_device_that_is_not_a_block_device_is_refused(tmp_path, nixl_agent):
    typo = tmp_path / "nvme0n1p9"
    with pytest.raises(ConfigError, match="not a block device"):
        make_store(config(tmp_path / "root", device=str(typo)), LAYOUT, nixl_agent)
    assert not typo.exists()  # nothing created in its place
    make_store(config(tmp_path / "root"), LAYOUT, nixl_agent).close()  # and the failed start left no lock behind


def test_one_writer_per_root(tmp_path, opened, nixl_agent):
    opened(config(tmp_path))
    with pytest.raises(RuntimeError, match="written by another process"):
        make_store(config(tmp_path), LAYOUT, nixl_agent)


# -- restart and crashes --------------------------------------------------------------------------


def test_restart_replays_the_journal_and_lookup_only_instances_follow(tmp_path, nixl_agent, pools):
    reader = make_store(config(tmp_path), LAYOUT)  # lookup only, like vLLM's scheduler half
    store = make_store(config(tmp_path), LAYOUT, nixl_agent)
    src, dst = pools(), pools()  # after the store: its backend must exist before memory is registered
    store.write(KEYS[:5], fill(src, KEYS[:5]))
    store.delete([KEYS[4]])
    assert reader.lookup(KEYS[:5]) == 4
    store.close()
    again = make_store(config(tmp_path), LAYOUT, nixl_agent)
    try:
        assert again.lookup(KEYS[:5]) == 4
        assert read_back(again, dst, KEYS[:5]) == [True] * 4 + [False]
    finally:
        again.close()


def test_the_bytes_are_durable_before_the_bind_names_them(tmp_path, opened, pools, monkeypatch):
    store = opened(config(tmp_path))
    src = pools()
    calls = []
    for cls, name in ((ExtentFile, "sync"), (BindMap, "bind")):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, _o=original, _n=name: (calls.append(_n), _o(self, *a))[1])
    store.write(KEYS[:2], fill(src, KEYS[:2]))
    assert calls == ["sync", "bind"]


def test_a_crash_before_the_bytes_are_durable_leaves_no_chunk(tmp_path, nixl_agent, pools, monkeypatch):
    store = make_store(config(tmp_path), LAYOUT, nixl_agent)
    src = pools()

    def power_cut(self):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(ExtentFile, "sync", power_cut)
    with pytest.raises(KeyboardInterrupt):
        store.write(KEYS[:2], fill(src, KEYS[:2]))
    monkeypatch.undo()
    store.close()
    # The bytes may be in the extent file, but no bind names them: after a restart they are not a chunk.
    again = make_store(config(tmp_path), LAYOUT, nixl_agent)
    try:
        assert again.lookup(KEYS[:1]) == 0 and again.lookup(KEYS[1:2]) == 0
    finally:
        again.close()


def test_a_read_keeps_its_extent_while_a_delete_and_a_save_race_it(tmp_path, opened, pools, monkeypatch):
    """Mid-read, the chunk is deleted and a save needs room: the save must evict another chunk, not reuse the
    extent the read still moves bytes out of."""
    store = opened(config(tmp_path))  # 8 extents
    src, dst = pools(16), pools()
    store.write(KEYS[:8], fill(src, KEYS[:8]))
    extent = BindMap(str(tmp_path / JOURNAL), 8, writer=False).bindings[KEYS[0]].extent
    transfer = store._transfer
    raced = []

    def racing(op, chunks):
        if op == "READ" and not raced:
            raced.append(True)
            store.delete([KEYS[0]])
            assert store.write(KEYS[8:10], fill(src, KEYS[8:10])) == [True, True]
        return transfer(op, chunks)

    monkeypatch.setattr(store, "_transfer", racing)
    assert read_back(store, dst, KEYS[:1]) == [True]  # the bytes it had when the read began
    assert store.lookup(KEYS[:1]) == 0
    bound = BindMap(str(tmp_path / JOURNAL), 8, writer=False).bindings
    assert extent not in {bound[key].extent for key in KEYS[8:10]}
    assert read_back(store, dst, KEYS[8:10]) == [True, True]
    # Once the read ended, the deleted chunk's extent is free again: a save may take it.
    assert store.write(KEYS[10:11], fill(src, KEYS[10:11])) == [True]


def test_a_torn_journal_record_is_dropped(tmp_path, nixl_agent, pools):
    store = make_store(config(tmp_path), LAYOUT, nixl_agent)
    src = pools()
    store.write(KEYS[:2], fill(src, KEYS[:2]))
    store.close()
    journal = tmp_path / JOURNAL
    whole = journal.read_bytes()
    journal.write_bytes(whole[: len(whole) - 7])  # the crash hit the second record's append
    again = make_store(config(tmp_path), LAYOUT, nixl_agent)
    try:
        assert [again.lookup([k]) for k in KEYS[:2]] == [1, 0]
        assert again.write(KEYS[2:3], fill(src, KEYS[2:3])) == [True]
    finally:
        again.close()
    assert make_store(config(tmp_path), LAYOUT).lookup(KEYS[2:3]) == 1  # appended after the cut: readable


_WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from nixl._api import nixl_agent, nixl_agent_config
    from nixl_backends.buffers import HostBufferPool
    from nixl_backends.registry import make_store
    from tests.integration.test_dualblade import KEYS, LAYOUT, config, expected
    agent = nixl_agent("crash-writer", nixl_agent_config(backends=[]))
    store = make_store(config({root!r}), LAYOUT, agent)
    pool = HostBufferPool(agent, LAYOUT.object_bytes, 1)
    for round in range(1_000_000):
        key = KEYS[round % len(KEYS)]
        store.delete([key])  # rewrite it: extents are reused all the time
        pool.slot_view(0)[:] = expected(key)
        store.write([key], [pool.slot_addr(0)])
        print(round, flush=True)
""")


def test_a_writer_killed_mid_run_never_leaves_wrong_bytes(tmp_path, nixl_agent, pools):
    """SIGKILL at an arbitrary point of a rewrite loop; every chunk the journal names reads back exactly."""
    script = _WRITER.format(repo=REPO, root=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             cwd=REPO)
    try:
        for _ in range(40):  # 40 completed writes, then the kill lands wherever the loop is
            assert child.stdout.readline(), "the writer died on its own"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    store = make_store(config(tmp_path), LAYOUT, nixl_agent)
    try:
        resident = [key for key in KEYS if store.lookup([key])]
        assert resident
        assert read_back(store, pools(16), resident) == [True] * len(resident)
    finally:
        store.close()


# -- corruption -----------------------------------------------------------------------------------


def _flip_byte_of(tmp_path, key: str, offset: int) -> None:
    extent = BindMap(str(tmp_path / JOURNAL), 8, writer=False).bindings[key].extent
    with open(tmp_path / EXTENTS, "r+b") as extents:
        extents.seek(extent * EXTENT + offset)
        byte = extents.read(1)
        extents.seek(extent * EXTENT + offset)
        extents.write(bytes([byte[0] ^ 0x01]))


def test_a_byte_changed_on_disk_is_a_miss_and_frees_the_chunk(tmp_path, opened, pools):
    store = opened(config(tmp_path, page_cache_bytes=0))
    src, dst = pools(), pools()
    store.write(KEYS[:2], fill(src, KEYS[:2]))
    _flip_byte_of(tmp_path, KEYS[1], LAYOUT.layer_range(5)[0] + 3)  # on the direct path
    # The direct path reads the device, not a stale cached page: the flipped byte is seen and refused.
    assert store.read(KEYS[:2], [dst.slot_addr(0), dst.slot_addr(1)]) == [True, False]
    assert store.lookup(KEYS[1:2]) == 0
    assert store.metrics().counters["local_tier_corrupt_chunks"] == 1


# -- the page-cache budget ------------------------------------------------------------------------


def test_the_knob_is_spread_over_every_extent_and_the_rest_goes_to_the_hottest(tmp_path, opened, pools):
    knob = 12 * 12 * 1024  # twelve layers for eight extents: one each, and one more for the four hottest
    store = opened(config(tmp_path, page_cache_bytes=knob, replan_interval_s=3600))
    src, dst = pools(), pools()
    assert store.plan.page_cache_layers == 1  # planned for the capacity, before any chunk is resident
    store.write(KEYS[:8], fill(src, KEYS[:8]))
    assert read_back(store, dst, KEYS[2:4]) == [True, True]
    plan = store.replan()
    assert plan.page_cache_layers == 1 and plan.boosted == set(KEYS[2:4] + KEYS[6:8])  # the four most recent
    assert [plan.layers_for(key) for key in KEYS[:8]] == [1, 1, 2, 2, 1, 1, 2, 2]
    assert read_back(store, dst, KEYS[:8]) == [True] * 8


def test_a_shrinking_budget_drops_exactly_the_layers_that_left_the_page_cache(tmp_path, opened, pools, monkeypatch):
    store = opened(config(tmp_path, page_cache_bytes=3 * 8 * 12 * 1024, replan_interval_s=3600))  # n1 = 3
    src = pools()
    store.write(KEYS[:2], fill(src, KEYS[:2]))
    dropped = []
    monkeypatch.setattr(ExtentFile, "drop_cached", lambda self, offset, length: dropped.append((offset, length)))
    # The cgroup's budget falls to one layer of every extent (the headroom is taken off what it says).
    monkeypatch.setattr(store._budgeter, "page_cache_budget", lambda: int(8 * 12 * 1024 / 0.9) + 1)
    assert store.replan().page_cache_layers == 1
    extents = BindMap(str(tmp_path / JOURNAL), 8, writer=False).bindings
    # Layers 1 and 2 (bytes 12 KiB .. 36 KiB, both ends on page boundaries) of each resident chunk, nothing else.
    assert sorted(dropped) == sorted((extents[key].extent * EXTENT + 12 * 1024, 24 * 1024) for key in KEYS[:2])


def test_ranked_residency_caches_the_hottest_chunks_whole(tmp_path, opened, pools):
    knob = 2 * LAYOUT.full_block_bytes  # two whole chunks
    store = opened(config(tmp_path, page_cache_bytes=knob, residency="ranked", replan_interval_s=3600))
    src, dst = pools(), pools()
    store.write(KEYS[:6], fill(src, KEYS[:6]))
    assert read_back(store, dst, [KEYS[1]]) == [True]
    plan = store.replan()
    assert plan.boosted == {KEYS[1], KEYS[5]} and plan.layers_for(KEYS[0]) == 0
    assert plan.layers_for(KEYS[1]) == LAYOUT.num_layers
    before = store.metrics().counters["local_tier_direct_bytes_read"]
    assert read_back(store, dst, [KEYS[1], KEYS[5]]) == [True, True]
    assert store.metrics().counters["local_tier_direct_bytes_read"] == before  # all through the page cache
    assert read_back(store, dst, KEYS[:6]) == [True] * 6


# -- tiered ---------------------------------------------------------------------------------------


def tiered(tmp_path, **extra):
    return parse_store_config({"backend": "tiered", **extra, "tiers": [
        {"backend": "dualblade", "root": str(tmp_path / "local"), "capacity_bytes": 4 * EXTENT},
        {"backend": "posix", "root": str(tmp_path / "shared")},
    ]})


def test_tiered_writes_through_reads_fall_through_and_fill_the_local_tier(tmp_path, opened, pools):
    store = opened(tiered(tmp_path))
    local, shared = store.tiers
    src, dst = pools(16), pools(16)
    assert store.write(KEYS[:6], fill(src, KEYS[:6])) == [True] * 6
    # A batch larger than the local tier keeps its front: a prompt's leading chunks are what lookups need.
    assert shared.lookup(KEYS[:6]) == 6 and local.lookup(KEYS[:6]) == 4
    assert store.lookup(KEYS[:6]) == 6
    assert read_back(store, dst, KEYS[:6]) == [True] * 6
    assert store.wait_for_fills()
    counters = store.metrics().counters
    assert counters["local_tier_filled_chunks"] == 2 and counters["local_tier_hit_chunks"] == 4
    # 4 and 5 were filled in place of the coldest two (0 and 1, read first).
    assert [local.lookup([key]) for key in KEYS[:6]] == [0, 0, 1, 1, 1, 1]
    store.delete(KEYS[2:3])
    assert local.lookup(KEYS[2:3]) == 0 and shared.lookup(KEYS[2:3]) == 0


def test_tiered_lookup_is_the_union_of_the_tiers_runs(tmp_path, opened, pools):
    store = opened(tiered(tmp_path))
    local, shared = store.tiers
    src = pools()
    local.write([KEYS[0], KEYS[2]], fill(src, [KEYS[0], KEYS[2]]))
    shared.write([KEYS[1]], fill(src, [KEYS[1]]))
    assert store.lookup(KEYS[:4]) == 3


def test_a_corrupt_local_chunk_is_read_from_the_next_tier(tmp_path, opened, pools):
    store = opened(tiered(tmp_path))
    src, dst = pools(), pools()
    store.write(KEYS[:2], fill(src, KEYS[:2]))
    _flip_byte_of(tmp_path / "local", KEYS[0], 10)
    assert read_back(store, dst, KEYS[:2]) == [True, True]
    counters = store.metrics().counters
    assert counters["local_tier_corrupt_chunks"] == 1 and counters["local_tier_hit_chunks"] == 1


def test_fills_without_a_free_slot_are_skipped_not_waited_for(tmp_path, opened, pools):
    store = opened(tiered(tmp_path, fill_buffer_bytes=LAYOUT.object_bytes))  # one slot
    shared = store.tiers[1]
    src, dst = pools(), pools()
    shared.write(KEYS[:3], fill(src, KEYS[:3]))
    assert read_back(store, dst, KEYS[:3]) == [True] * 3
    assert store.wait_for_fills()
    counters = store.metrics().counters
    assert counters["local_tier_filled_chunks"] == 1 and counters["local_tier_fill_skipped_chunks"] == 2
