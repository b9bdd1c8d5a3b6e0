"""KV events for the store: the scheduler half's bookkeeping, driven the way vLLM drives it, without an engine.

Requests are real ``vllm.v1.request.Request`` objects with vLLM's own block
hasher (sha256, 16-token blocks), so ``request.block_hashes`` are the hashes
vLLM's GPU-tier events carry. Chunks are 32 tokens: two vLLM blocks each.
Durability is reported as vLLM reports it, through ``SavedChunks`` (worker
metadata); gc's removal records are real objects under a POSIX root, read by
the real watcher (polled directly here, not on its timer).
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from dualpath_connector.config import ChunkGeometry, kv_events_enabled, parse_config
from dualpath_connector.metrics.kv_events import OWNERSHIP, RemovalWatcher
from dualpath_connector.metadata import SavedChunks
from dualpath_connector.scheduler.scheduler import DualPathScheduler
from nixl_backends.configuration import ConfigError
from nixl_backends.gc import KeyPattern, PosixChunks
from nixl_backends.removals import MAX_RECORD_BYTES, RECORDS_DIR, RecordError, RemovalLog, RemovalRecord, records_prefix
from tests.unit.test_scheduler import (
    BLOCK, CHUNK, KEY_PREFIX, NAMESPACE, FakeStore, InlineExecutor, hashes_of, keys_of, new_req, step,
)  # fmt: skip

NS = NAMESPACE.digest()
_HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(_HASH_FN)


def vllm_request(req_id: str, prompt: list[int], **options) -> Request:
    hasher = get_request_block_hasher(BLOCK, _HASH_FN)
    return Request(req_id, prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher, **options)


def prompt_of(num_tokens: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(num_tokens)]


def events_scheduler(tmp_path, world_size: int = 1, **extra) -> tuple[DualPathScheduler, FakeStore]:
    raw = {"store": {"backend": "posix", "root": str(tmp_path)}, "key_prefix": KEY_PREFIX, **extra}
    store = FakeStore()
    # One shard per rank, as a TP engine's scheduler is given them; rank 0's namespace is the engine's.
    shards = [dataclasses.replace(NAMESPACE, tp_rank=rank) for rank in range(world_size)]
    scheduler = DualPathScheduler(
        parse_config(raw), "kv_both", ChunkGeometry(block_size=BLOCK, chunk_tokens=CHUNK), shards[0], store,
        shards=shards, kv_events=True, lookup_executor=InlineExecutor(),
    )  # fmt: skip
    return scheduler, store


def save_all(scheduler: DualPathScheduler, request: Request, first_block_id: int = 100) -> list[str]:
    """vLLM asks, allocates and schedules the whole prompt in one step; the chunks the scheduler saves."""
    scheduler.get_num_new_matched_tokens(request, 0)
    num_blocks = -(-request.num_tokens // BLOCK)
    block_ids = list(range(first_block_id, first_block_id + num_blocks))
    meta = scheduler.build_connector_meta(step(new=[new_req(request.request_id, block_ids)],
                                               scheduled={request.request_id: request.num_tokens}))  # fmt: skip
    return [h for spec in meta.saves for h in spec.chunk_hashes]


def stored_blocks(events: list) -> list[tuple]:
    assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" and len(e.block_hashes) == 1 for e in events)
    return [(e.block_hashes[0], e.parent_block_hash, e.token_ids, e.block_size, e.lora_id) for e in events]


def published(block_hashes) -> list:
    """Hashes as vLLM's GPU-tier events publish them (64-bit ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    return [maybe_convert_block_hash(h) for h in block_hashes]


def expected_blocks(request: Request, blocks: range) -> list[tuple]:
    tokens, hashes = request.all_token_ids, published(request.block_hashes)
    return [(hashes[b], hashes[b - 1] if b else None, tokens[b * BLOCK : (b + 1) * BLOCK], BLOCK, None) for b in blocks]


# -- stored ---------------------------------------------------------------------


def test_a_chunk_is_announced_only_once_every_rank_wrote_it_one_event_per_vllm_block(tmp_path):
    scheduler, _ = events_scheduler(tmp_path, world_size=2)
    request = vllm_request("r1", prompt_of(3 * CHUNK + 5))
    hashes = save_all(scheduler, request)
    assert hashes == hashes_of(request.all_token_ids)
    # Planned (sent to the workers) is not stored.
    assert scheduler.take_events() == []
    scheduler.saves_finished(SavedChunks(stored={hashes[0]: 1, hashes[2]: 1}))
    assert scheduler.take_events() == []  # one rank of two
    both = SavedChunks(stored={hashes[0]: 1}).aggregate(SavedChunks(stored={hashes[2]: 1, hashes[1]: 1}))
    scheduler.saves_finished(both)
    # Chunks 0 and 2 are durable; chunk 1 has one rank of two.
    durable = expected_blocks(request, range(0, 2)) + expected_blocks(request, range(4, 6))
    assert stored_blocks(scheduler.take_events()) == durable
    scheduler.saves_finished(SavedChunks(stored={hashes[1]: 1}))
    assert stored_blocks(scheduler.take_events()) == expected_blocks(request, range(2, 4))
    assert scheduler.get_stats().data["kv_events_stored_blocks"] == 6


def test_salted_and_adapter_blocks_carry_their_extra_keys_as_vllms_own_events_do(tmp_path):
    """The salt on the prompt's first block, the adapter's name on every block; hashes are vLLM's salted ones."""
    from vllm.lora.request import LoRARequest

    scheduler, _ = events_scheduler(tmp_path)
    lora = LoRARequest("adapter-a", 3, "/adapters/a")
    request = vllm_request("r1", prompt_of(2 * CHUNK + 5), cache_salt="tenant-a", lora_request=lora)
    plain = vllm_request("r0", prompt_of(2 * CHUNK + 5))
    assert not set(request.block_hashes) & set(plain.block_hashes)  # vLLM's own hashes are salted
    hashes = save_all(scheduler, request)
    assert not set(hashes) & set(hashes_of(request.all_token_ids))  # and so are the store's chunks
    scheduler.saves_finished(SavedChunks(stored={h: 1 for h in hashes}))
    events = scheduler.take_events()
    assert [e.block_hashes[0] for e in events] == published(request.block_hashes[:4])
    assert [e.extra_keys for e in events] == [[("adapter-a", "tenant-a")]] + [[("adapter-a",)]] * 3
    assert {(e.lora_name, e.lora_id) for e in events} == {("adapter-a", 3)}


def test_a_failed_write_is_never_announced_and_reports_for_unplanned_chunks_are_ignored(tmp_path):
    scheduler, _ = events_scheduler(tmp_path)
    request = vllm_request("r1", prompt_of(2 * CHUNK))
    hashes = save_all(scheduler, request)
    scheduler.saves_finished(SavedChunks(failed={hashes[0]}))
    scheduler.saves_finished(SavedChunks(stored={hashes[0]: 1, "f" * 64: 1}))
    assert scheduler.take_events() == []
    scheduler.saves_finished(SavedChunks(stored={hashes[1]: 1}))
    assert stored_blocks(scheduler.take_events()) == expected_blocks(request, range(2, 4))


def test_each_block_is_announced_once_however_often_its_chunk_is_saved(tmp_path):
    scheduler, _ = events_scheduler(tmp_path)
    first, second = vllm_request("r1", prompt_of(2 * CHUNK)), vllm_request("r2", prompt_of(2 * CHUNK))
    hashes = save_all(scheduler, first)
    assert save_all(scheduler, second, first_block_id=200) == hashes  # both save (neither found it stored yet)
    report = SavedChunks(stored=dict.fromkeys(hashes, 1))
    scheduler.saves_finished(report)
    assert len(scheduler.take_events()) == 4
    scheduler.saves_finished(report)
    scheduler.saves_finished(SavedChunks(stored=dict.fromkeys(hashes, 1)))
    assert scheduler.take_events() == []


def test_no_events_unless_enabled(tmp_path):
    raw = {"store": {"backend": "posix", "root": str(tmp_path)}, "key_prefix": KEY_PREFIX}
    scheduler = DualPathScheduler(parse_config(raw), "kv_both", ChunkGeometry(BLOCK, CHUNK), NAMESPACE, FakeStore(),
                                  lookup_executor=InlineExecutor())  # fmt: skip
    request = vllm_request("r1", prompt_of(2 * CHUNK))
    hashes = save_all(scheduler, request)
    assert len(hashes) == 2  # saving is unchanged
    scheduler.saves_finished(SavedChunks(stored=dict.fromkeys(hashes, 1)))
    assert scheduler.take_events() == [] and scheduler.events is None


def test_the_event_queue_is_bounded_and_drops_are_counted(tmp_path):
    scheduler, _ = events_scheduler(tmp_path, kv_events_max_queued=3)
    request = vllm_request("r1", prompt_of(2 * CHUNK))
    hashes = save_all(scheduler, request)
    scheduler.saves_finished(SavedChunks(stored=dict.fromkeys(hashes, 1)))
    # Chunk 0's two blocks fit; chunk 1's two would make four.
    assert stored_blocks(scheduler.take_events()) == expected_blocks(request, range(0, 2))
    assert scheduler.get_stats().data["kv_events_dropped"] == 2
    # The dropped chunk was not remembered as announced: its next save announces it.
    again = vllm_request("r2", prompt_of(2 * CHUNK))
    save_all(scheduler, again, first_block_id=300)
    scheduler.saves_finished(SavedChunks(stored={hashes[1]: 1}))
    assert stored_blocks(scheduler.take_events()) == expected_blocks(again, range(2, 4))


# -- removed ---------------------------------------------------------------------


@pytest.fixture
def watched(tmp_path):
    """A scheduler that announced a 3-chunk prompt, and gc's record log under a POSIX root."""
    scheduler, store = events_scheduler(tmp_path / "unused")
    log = RemovalLog(PosixChunks(str(tmp_path), KeyPattern(KEY_PREFIX, [NS])), KEY_PREFIX)
    scheduler.removal_watcher = RemovalWatcher(
        log, NS, store, scheduler.key_space.key, scheduler.events, scheduler.stats, interval_s=3600.0
    )
    request = vllm_request("r1", prompt_of(3 * CHUNK))
    hashes = save_all(scheduler, request)
    store.present.update(keys_of(request.all_token_ids))
    scheduler.saves_finished(SavedChunks(stored=dict.fromkeys(hashes, 1)))
    assert len(scheduler.take_events()) == 6
    yield SimpleNamespace(scheduler=scheduler, store=store, log=log, request=request, hashes=hashes, root=tmp_path)
    scheduler.removal_watcher.close()


def gc_deletes(w, chunk_hashes: list[str]) -> None:
    """What ``dualpath-kv gc`` does: the chunks leave the store, a record names them."""
    keys = keys_of(w.request.all_token_ids)
    w.store.present.difference_update(keys[i] for i, h in enumerate(w.hashes) if h in chunk_hashes)
    w.log.write(RemovalRecord(NS, 1_000, tuple(chunk_hashes)))


def test_a_gc_removal_is_announced_with_the_block_hashes_that_were_announced(watched):
    w = watched
    gc_deletes(w, [w.hashes[1], "e" * 64])  # and one chunk this engine never announced
    w.scheduler.removal_watcher.poll()
    (event,) = w.scheduler.take_events()
    assert isinstance(event, BlockRemoved) and event.medium == "STORAGE"
    assert event.block_hashes == published(w.request.block_hashes[2:4])
    assert w.scheduler.get_stats().data["kv_events_removed_blocks"] == 2
    # A record is read once; a removed chunk is not announced removed twice.
    w.scheduler.removal_watcher.poll()
    assert w.scheduler.take_events() == []
    # The lookup cache forgot it too: vLLM's next ask goes to the store, which has chunk 0 only.
    w.store.calls.clear()
    assert w.scheduler.get_num_new_matched_tokens(vllm_request("r2", prompt_of(3 * CHUNK)), 0) == (CHUNK, True)
    assert w.store.calls


def test_a_record_naming_a_chunk_still_stored_is_not_believed(watched):
    """Chunks are content-addressed: a chunk gc deleted may be stored again, or the record may lie."""
    w = watched
    w.log.write(RemovalRecord(NS, 1_000, (w.hashes[0],)))  # the chunk is still in the store
    w.scheduler.removal_watcher.poll()
    assert w.scheduler.take_events() == []


def _bad_records(w) -> dict[str, bytes]:
    good = RemovalRecord(NS, 1_000, (w.hashes[0],))
    tampered = json.loads(good.encode())
    tampered["chunk_hashes"] = [w.hashes[1]]  # checksum of the original
    newer = json.loads(good.encode())
    newer["version"] = 2
    return {
        "not JSON": b"\xff\x00 garbage",
        "checksum": json.dumps(tampered).encode(),
        "version": json.dumps(newer).encode(),
        "namespace": RemovalRecord("0" * 32, 1_000, (w.hashes[0],)).encode(),
        "longer than": b" " * (MAX_RECORD_BYTES + 1),
        "lowercase hex": RemovalRecord(NS, 1_000, ("X" * 64,)).encode(),
    }


def test_bad_records_are_ignored_and_counted_and_a_good_one_beside_them_still_counts(watched):
    w = watched
    prefix = records_prefix(KEY_PREFIX, NS)
    for i, data in enumerate(_bad_records(w).values()):
        w.log.objects.put(f"{prefix}{i:020d}-{i:016x}.json", data)
    w.log.objects.put(f"{prefix}not-a-record-name", b"{}")  # not a name gc writes: not even read
    w.store.present.clear()  # everything is gone, so only the records' validity decides
    gc_deletes(w, [w.hashes[2]])
    w.scheduler.removal_watcher.poll()
    (event,) = w.scheduler.take_events()
    assert event.block_hashes == published(w.request.block_hashes[4:6])
    assert w.scheduler.get_stats().data["gc_records_rejected"] == 6


@pytest.mark.parametrize("what", ["not JSON", "checksum", "version", "namespace", "longer than", "lowercase hex"])
def test_each_bad_record_fails_its_own_check(watched, what):
    with pytest.raises(RecordError, match=what):
        RemovalRecord.decode(_bad_records(watched)[what], NS)


def test_a_record_round_trips_and_lives_apart_from_chunk_keys(tmp_path):
    record = RemovalRecord(NS, 123, ("a" * 64, "b" * 64))
    assert RemovalRecord.decode(record.encode(), NS) == record
    log = RemovalLog(PosixChunks(str(tmp_path), KeyPattern(KEY_PREFIX, [NS])), KEY_PREFIX)
    key = log.write(record)
    assert key.startswith(f"{KEY_PREFIX}/{NS}/{RECORDS_DIR}/") and KeyPattern(KEY_PREFIX, None).parse(key) is None
    assert log.keys(NS) == [key] and log.read(key, NS) == record
    assert log.prune([NS], max_age_s=10, now_ns=123 + 5 * 10**9) == 0
    assert log.prune([NS], max_age_s=10, now_ns=123 + 11 * 10**9) == 1 and log.keys(NS) == []


# -- configuration ---------------------------------------------------------------


def _vllm_config(enabled: bool | None, endpoint: str = "tcp://127.0.0.1:5557", replay: str | None = None):
    events = None if enabled is None else SimpleNamespace(enable_kv_cache_events=enabled, publisher="zmq",
                                                          endpoint=endpoint, replay_endpoint=replay)
    return SimpleNamespace(kv_events_config=events)


@pytest.mark.parametrize("endpoint, replay", [("tcp://*:5557", None), ("tcp://0.0.0.0:5557", None),
                                              ("tcp://[::]:5557", None), ("tcp://127.0.0.1:5557", "tcp://*:5558")])
def test_a_publisher_on_every_interface_stops_start_up_unless_allowed(tmp_path, endpoint, replay):
    """vLLM's default endpoint (tcp://*) would hand every stored block's token ids to whoever connects."""
    store = {"backend": "posix", "root": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"binds every interface.*kv_events_public_bind: true"):
        kv_events_enabled(_vllm_config(True, endpoint, replay), parse_config({"store": store}))
    allowed = parse_config({"store": store, "kv_events_public_bind": True})
    assert kv_events_enabled(_vllm_config(True, endpoint, replay), allowed) is True
    # Control: one address (or events off) starts.
    assert kv_events_enabled(_vllm_config(True, "tcp://10.0.0.5:5557"), parse_config({"store": store})) is True
    assert kv_events_enabled(_vllm_config(True, endpoint, replay), parse_config({"store": store, "kv_events": False})) is False


def test_token_ids_can_be_left_out_of_the_stores_events(tmp_path):
    scheduler, _ = events_scheduler(tmp_path, kv_events_token_ids=False)
    request = vllm_request("r1", prompt_of(CHUNK + 3))
    hashes = save_all(scheduler, request)
    scheduler.saves_finished(SavedChunks(stored={h: 1 for h in hashes}))
    events = scheduler.take_events()
    assert len(events) == 2 and all(e.token_ids == [] for e in events)
    assert [e.block_hashes[0] for e in events] == published(request.block_hashes[:2])


@pytest.mark.parametrize("vllm_events", [None, False, True])
def test_events_follow_vllms_kv_events_config_by_default(tmp_path, vllm_events):
    config = parse_config({"store": {"backend": "posix", "root": str(tmp_path)}})
    assert kv_events_enabled(_vllm_config(vllm_events), config) is bool(vllm_events)
    off = parse_config({"store": {"backend": "posix", "root": str(tmp_path)}, "kv_events": False})
    assert kv_events_enabled(_vllm_config(vllm_events), off) is False


def test_kv_events_true_without_vllms_events_fails_naming_the_key(tmp_path):
    config = parse_config({"store": {"backend": "posix", "root": str(tmp_path)}, "kv_events": True})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.kv_events is true .*--kv-events-config"):
        kv_events_enabled(_vllm_config(False), config)
    assert kv_events_enabled(_vllm_config(True), config) is True


@pytest.mark.parametrize(("key", "value", "message"), [
    ("kv_events_max_queued", 0, "kv_events_max_queued must be positive"),
    ("kv_events_gc_poll_s", -1, "kv_events_gc_poll_s must not be negative"),
    ("kv_events", "yes", "bad value for kv_connector_extra_config.'kv_events'"),
    ("kv_events_locality", "local", "bad value for kv_connector_extra_config.'kv_events_locality'"),
])  # fmt: skip
def test_bad_event_settings_fail_naming_the_key(tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("'", "'")):
        parse_config({"store": {"backend": "posix", "root": str(tmp_path)}, key: value})


def test_events_carry_the_stores_locality_this_connectors_ownership_and_the_spec_kind(tmp_path):
    """As vLLM's own storage tiers tag theirs: a router tells a tier the engine reads itself from a shared one."""
    scheduler, _ = events_scheduler(tmp_path)  # a posix root: LOCAL unless the config says it is shared
    scheduler.events.spec_kind = "full_attention"  # what from_vllm passes for a model without MLA
    request = vllm_request("r1", prompt_of(CHUNK))
    (chunk,) = save_all(scheduler, request)
    scheduler.saves_finished(SavedChunks(stored={chunk: 1}))
    stored = scheduler.take_events()
    assert {(e.locality, e.ownership, e.kv_cache_spec_kind) for e in stored} == {("LOCAL", OWNERSHIP, "full_attention")}
    shared, _ = events_scheduler(tmp_path, kv_events_locality="REMOTE")  # a root every engine mounts
    assert shared.events.locality == "REMOTE"


@pytest.mark.parametrize(("store", "locality"), [
    ({"backend": "posix", "root": "/r"}, "LOCAL"),
    ({"backend": "dualblade", "root": "/r"}, "LOCAL"),
    ({"backend": "s3", "bucket": "kv-bucket"}, "REMOTE"),
    ({"backend": "s3agg", "gateway": "http://127.0.0.1:9100", "s3": {"bucket": "kv-bucket"}}, "REMOTE"),
    ({"backend": "tiered", "tiers": [{"backend": "dualblade", "root": "/r"}, {"backend": "s3", "bucket": "kv-bucket"}]},
     "REMOTE"),
    ({"backend": "tiered", "tiers": [{"backend": "dualblade", "root": "/r"}, {"backend": "posix", "root": "/p"}]},
     "LOCAL"),
])  # fmt: skip
def test_the_events_locality_defaults_to_the_stores(store, locality):
    assert parse_config({"store": store}).kv_events_locality == locality
