"""DualPathScheduler: hits, loads, saves, PD hand-offs and pulls, driven the way vLLM drives them.

No vLLM engine and no store: requests and scheduler outputs are plain objects
shaped like ``vllm.v1.request.Request`` and ``vllm.v1.core.sched.output``'s
``NewRequestData`` / ``CachedRequestData``, and the store is a fake that
records every lookup. Geometry: 16-token blocks, 32-token chunks (2 blocks a chunk).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from types import SimpleNamespace

import pytest
from vllm.v1.request import RequestStatus

from dualpath_connector.config import ChunkGeometry, parse_config
from dualpath_connector.metadata import ChunkLoad, PullSpec, SaveSpec
from dualpath_connector.protocol import VERSION_KEY, PrefillHandoff, PrefillRequest, RetainedDecode
from dualpath_connector.scheduler.scheduler import MAX_LOAD_ATTEMPTS, DualPathScheduler
from nixl_backends.layout import KVNamespace, chunk_hashes, chunk_key, isolated_chain

BLOCK = 16
CHUNK = 32
PORT = 5601
KEY_PREFIX = "kv-test"  # not the default ("dualpath"): the configured prefix must reach the keys

NAMESPACE = KVNamespace(
    model="test-model",
    dtype="bfloat16",
    block_size=BLOCK,
    chunk_tokens=CHUNK,
    num_layers=2,
    num_kv_heads=2,
    head_size=8,
    kv_layout="NHD",
    layer_block_bytes=2 * 2 * 8 * CHUNK * 2,
)


# -- fakes and helpers ---------------------------------------------------------


class FakeStore:
    """``lookup`` answers the leading run of ``present`` keys; every call is recorded."""

    def __init__(self) -> None:
        self.present: set[str] = set()
        self.calls: list[list[str]] = []
        self.down = False
        self.closed = False

    def lookup(self, keys):
        self.calls.append(list(keys))
        if self.down:
            raise ConnectionError("store unreachable")
        found = 0
        while found < len(keys) and keys[found] in self.present:
            found += 1
        return found

    def close(self) -> None:
        self.closed = True


class InlineExecutor(Executor):
    """Runs each call in the caller's thread, so the lane answers in the same call (these tests: an answer in the
    call that asks, whatever the engine did last step)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


def make_scheduler(tmp_path, kv_role="kv_both", clock=time.monotonic, **extra) -> tuple[DualPathScheduler, FakeStore]:
    raw = {"store": {"backend": "posix", "root": str(tmp_path)}, "key_prefix": KEY_PREFIX, **extra}
    if kv_role != "kv_both":
        raw.setdefault("side_channel_port", PORT)
    store = FakeStore()
    scheduler = DualPathScheduler(
        parse_config(raw, kv_role), kv_role, ChunkGeometry(block_size=BLOCK, chunk_tokens=CHUNK), NAMESPACE, store,
        lookup_executor=InlineExecutor(), clock=clock,
    )
    return scheduler, store


def prompt_of(num_tokens: int, seed: int = 1) -> list[int]:
    return [seed * 10_000 + i for i in range(num_tokens)]


def hashes_of(tokens: list[int]) -> list[str]:
    return chunk_hashes(NAMESPACE.digest(), tokens, CHUNK)


def keys_of(tokens: list[int]) -> list[str]:
    """The store keys, computed here rather than by the scheduler: a scheduler keying under another prefix or
    namespace than the configured one (where the worker writes) finds nothing."""
    return [chunk_key(KEY_PREFIX, NAMESPACE.digest(), h) for h in hashes_of(tokens)]


def store_chunks(store, tokens, num_chunks) -> None:
    """Put the first ``num_chunks`` chunks of ``tokens`` into the fake store."""
    store.present.update(keys_of(tokens)[:num_chunks])


def make_request(req_id, prompt, kv_transfer_params=None, **overrides) -> SimpleNamespace:
    request = SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        all_token_ids=list(prompt),
        num_tokens=len(prompt),
        kv_transfer_params=kv_transfer_params,
        lora_request=None,
        mm_features=[],
        cache_salt=None,
        prompt_embeds=None,
        status=RequestStatus.WAITING,
    )
    for name, value in overrides.items():
        setattr(request, name, value)
    return request


def append_tokens(request, tokens) -> None:
    request.all_token_ids.extend(tokens)
    request.num_tokens = len(request.all_token_ids)


class Blocks:
    """Shaped like vLLM's KVCacheBlocks: one KV cache group."""

    def __init__(self, block_ids) -> None:
        self._ids = list(block_ids)

    def get_block_ids(self):
        return (list(self._ids),)


def new_req(req_id, block_ids, num_computed_tokens=0) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, block_ids=(list(block_ids),), num_computed_tokens=num_computed_tokens)


def cached(req_id, num_computed_tokens, new_block_ids=None) -> SimpleNamespace:
    blocks = (list(new_block_ids),) if new_block_ids is not None else None
    return SimpleNamespace(req_id=req_id, num_computed_tokens=num_computed_tokens, new_block_ids=blocks)


def step(new=(), cached_reqs=(), scheduled=None, resumed=()) -> SimpleNamespace:
    """A SchedulerOutput with what the connector reads."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c.req_id for c in cached_reqs],
            resumed_req_ids=set(resumed),
            new_block_ids=[c.new_block_ids for c in cached_reqs],
            num_computed_tokens=[c.num_computed_tokens for c in cached_reqs],
        ),
        num_scheduled_tokens=dict(scheduled or {}),
    )


def empty_step() -> SimpleNamespace:
    return step()


# -- 1. partial prefix hit -----------------------------------------------------


def test_partial_prefix_hit_claims_the_stored_run_and_plans_its_load(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(5 * CHUNK + 7)
    store_chunks(store, prompt, 3)
    request = make_request("r1", prompt)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, True)

    blocks = [100 + i for i in range(6)]
    scheduler.update_state_after_alloc(request, Blocks(blocks), 3 * CHUNK)
    meta = scheduler.build_connector_meta(empty_step())

    assert len(meta.loads) == 1
    load = meta.loads[0]
    hashes = hashes_of(prompt)
    assert (load.req_id, load.read_side, load.de_side_channel) == ("r1", "pe", None)
    assert load.chunks == [
        ChunkLoad(hashes[0], 0, [100, 101]),
        ChunkLoad(hashes[1], 0, [102, 103]),
        ChunkLoad(hashes[2], 0, [104, 105]),
    ]
    assert meta.saves == [] and meta.pulls == []
    # The load is handed over once.
    assert scheduler.build_connector_meta(empty_step()).loads == []


def test_a_local_prefix_hit_skips_its_blocks_in_the_first_chunk(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(5 * CHUNK + 7)
    store_chunks(store, prompt, 3)
    request = make_request("r1", prompt)

    # vLLM's own prefix cache already holds the first block.
    assert scheduler.get_num_new_matched_tokens(request, BLOCK) == (3 * CHUNK - BLOCK, True)
    scheduler.update_state_after_alloc(request, Blocks(range(100, 106)), 3 * CHUNK - BLOCK)
    chunks = scheduler.build_connector_meta(empty_step()).loads[0].chunks

    hashes = hashes_of(prompt)
    assert chunks == [
        ChunkLoad(hashes[0], 1, [101]),
        ChunkLoad(hashes[1], 0, [102, 103]),
        ChunkLoad(hashes[2], 0, [104, 105]),
    ]


def test_a_local_hit_covering_whole_chunks_loads_only_the_rest(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(5 * CHUNK + 7)
    store_chunks(store, prompt, 3)
    request = make_request("r1", prompt)

    assert scheduler.get_num_new_matched_tokens(request, CHUNK) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks(range(100, 106)), 2 * CHUNK)
    chunks = scheduler.build_connector_meta(empty_step()).loads[0].chunks
    hashes = hashes_of(prompt)
    assert chunks == [ChunkLoad(hashes[1], 0, [102, 103]), ChunkLoad(hashes[2], 0, [104, 105])]


def test_a_local_hit_beyond_the_stored_run_claims_nothing(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(5 * CHUNK + 7)
    store_chunks(store, prompt, 2)
    request = make_request("r1", prompt)

    assert scheduler.get_num_new_matched_tokens(request, 3 * CHUNK) == (0, False)
    scheduler.update_state_after_alloc(request, Blocks(range(100, 110)), 0)
    assert scheduler.build_connector_meta(empty_step()).loads == []


def test_one_hit_is_capped_by_the_load_buffer(tmp_path):
    scheduler, store = make_scheduler(tmp_path, load_buffer_chunks=2)
    prompt = prompt_of(6 * CHUNK + 1)
    store_chunks(store, prompt, 6)
    request = make_request("r1", prompt)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks(range(4)), 2 * CHUNK)
    assert len(scheduler.build_connector_meta(empty_step()).loads[0].chunks) == 2


# -- 2. never the last token ---------------------------------------------------


def test_a_fully_stored_prompt_of_whole_chunks_leaves_the_last_chunk_to_compute(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(4 * CHUNK)
    store_chunks(store, prompt, 4)
    request = make_request("r1", prompt)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, True)
    # Only the 3 claimable chunks were looked up.
    assert store.calls == [keys_of(prompt)[:3]]


def test_a_one_chunk_prompt_is_not_looked_up(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(CHUNK)
    store_chunks(store, prompt, 1)

    assert scheduler.get_num_new_matched_tokens(make_request("r1", prompt), 0) == (0, False)
    assert store.calls == []


# -- 3. saves ------------------------------------------------------------------


def test_saves_cover_chunks_completed_by_each_step_and_skip_stored_ones(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(4 * CHUNK + 22)  # 150 tokens: 4 full chunks
    store_chunks(store, prompt, 1)
    request = make_request("r1", prompt)
    hashes = hashes_of(prompt)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks([10, 11]), CHUNK)
    scheduler.build_connector_meta(empty_step())

    # Chunked prefill: the first step computes tokens 32..95 (chunks 1 and 2).
    meta = scheduler.build_connector_meta(
        step(new=[new_req("r1", [10, 11, 12, 13, 14, 15], num_computed_tokens=CHUNK)], scheduled={"r1": 2 * CHUNK})
    )
    assert meta.saves == [SaveSpec("r1", hashes[1:3], [[12, 13], [14, 15]])]

    # The next step computes the rest of the prompt: only chunk 3 is new.
    meta = scheduler.build_connector_meta(
        step(cached_reqs=[cached("r1", 3 * CHUNK, [16, 17, 18, 19])], scheduled={"r1": 150 - 3 * CHUNK})
    )
    assert meta.saves == [SaveSpec("r1", [hashes[3]], [[16, 17]])]

    # A decode step that completes no chunk saves nothing.
    append_tokens(request, [7])
    meta = scheduler.build_connector_meta(step(cached_reqs=[cached("r1", 150)], scheduled={"r1": 1}))
    assert meta.saves == []


def test_a_step_completing_no_chunk_saves_nothing(tmp_path):
    scheduler, _ = make_scheduler(tmp_path)
    request = make_request("r1", prompt_of(100))
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)

    meta = scheduler.build_connector_meta(step(new=[new_req("r1", [0, 1])], scheduled={"r1": CHUNK - 1}))
    assert meta.saves == []


def test_async_scheduling_placeholders_are_not_saved(tmp_path):
    scheduler, _ = make_scheduler(tmp_path)
    prompt = prompt_of(2 * CHUNK - 1)  # 63 tokens
    request = make_request("r1", prompt)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)

    meta = scheduler.build_connector_meta(step(new=[new_req("r1", [10, 11, 12, 13])], scheduled={"r1": 63}))
    assert meta.saves == [SaveSpec("r1", hashes_of(prompt)[:1], [[10, 11]])]

    # Async scheduling: token 63 is scheduled before it was sampled, so
    # computed + scheduled (64) runs past the tokens that exist (63).
    meta = scheduler.build_connector_meta(step(cached_reqs=[cached("r1", 63)], scheduled={"r1": 1}))
    assert meta.saves == []

    # Once token 63 exists, its chunk is saved, hashed over the real token.
    append_tokens(request, [4242])
    meta = scheduler.build_connector_meta(step(cached_reqs=[cached("r1", 64, [14])], scheduled={"r1": 1}))
    assert meta.saves == [SaveSpec("r1", [hashes_of(request.all_token_ids)[1]], [[12, 13]])]


# -- 4. preempted and resumed --------------------------------------------------


def test_a_resumed_request_saves_into_its_new_blocks(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(3 * CHUNK + 4)  # 100 tokens
    hashes = hashes_of(prompt)
    request = make_request("r1", prompt)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)

    meta = scheduler.build_connector_meta(step(new=[new_req("r1", [0, 1, 2])], scheduled={"r1": 40}))
    assert meta.saves == [SaveSpec("r1", hashes[:1], [[0, 1]])]

    # Preempted: its blocks are freed; vLLM asks again, then resumes it with
    # a whole new block list and recomputes from the start.
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)
    resumed_blocks = [20, 21, 22, 23, 24, 25, 26]
    meta = scheduler.build_connector_meta(
        step(cached_reqs=[cached("r1", 0, resumed_blocks)], scheduled={"r1": 100}, resumed={"r1"})
    )
    # Chunk 0 was already handed over; chunks 1 and 2 use the new blocks.
    assert meta.saves == [SaveSpec("r1", hashes[1:3], [[22, 23], [24, 25]])]


def test_a_running_request_extends_its_block_list(tmp_path):
    scheduler, _ = make_scheduler(tmp_path)
    prompt = prompt_of(3 * CHUNK + 4)
    hashes = hashes_of(prompt)
    request = make_request("r1", prompt)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)

    scheduler.build_connector_meta(step(new=[new_req("r1", [0, 1, 2])], scheduled={"r1": 40}))
    meta = scheduler.build_connector_meta(step(cached_reqs=[cached("r1", 40, [3, 4, 5, 6])], scheduled={"r1": 60}))
    assert meta.saves == [SaveSpec("r1", hashes[1:3], [[2, 3], [4, 5]])]


# -- 5 and 6. decode engine: pulls ----------------------------------------------


HOLD_TOKEN = "c0" * 16


def handoff(num_remote_blocks=7, stored_chunks=1) -> PrefillHandoff:
    return PrefillHandoff(
        remote_side_channel="pe-host:7001",
        remote_request_id="pe-r1",
        remote_block_ids=[500 + i for i in range(num_remote_blocks)],
        stored_chunks=stored_chunks,
        hold_token=HOLD_TOKEN,
    )


def test_de_abort_before_the_pull_releases_the_pe_blocks(tmp_path):
    scheduler, store = make_scheduler(tmp_path, "kv_consumer")
    request = make_request("d1", prompt_of(100), handoff().to_dict())

    assert scheduler.get_num_new_matched_tokens(request, 0) == (100, True)
    assert store.calls == []  # the PE's hand-off needs no lookup

    request.status = RequestStatus.FINISHED_ABORTED
    assert scheduler.request_finished(request, []) == (False, None)
    meta = scheduler.build_connector_meta(empty_step())
    assert meta.pulls == [PullSpec("d1", "pe-host:7001", "pe-r1", HOLD_TOKEN, [], [])]
    assert meta.dropped_req_ids == ["d1"]
    assert meta.loads == []


def test_de_pull_maps_every_remote_prompt_block_onto_a_local_one(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    request = make_request("d1", prompt_of(100), handoff().to_dict())

    assert scheduler.get_num_new_matched_tokens(request, 0) == (100, True)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100)
    meta = scheduler.build_connector_meta(empty_step())

    assert meta.pulls == [PullSpec("d1", "pe-host:7001", "pe-r1", HOLD_TOKEN, list(range(500, 507)), list(range(10, 17)))]
    assert meta.loads == []
    # Asked again (after a failed pull), the DE recomputes instead of pulling again.
    assert request.kv_transfer_params["do_remote_prefill"] is False


def test_vllms_hit_metrics_name_a_pull_p2p_and_a_store_hit_by_the_stores_locality(tmp_path):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    de, _ = make_scheduler(tmp_path, "kv_consumer")
    pulled = make_request("d1", prompt_of(100), handoff().to_dict())
    assert de.get_num_new_matched_tokens(pulled, 0) == (100, True)
    de.update_state_after_alloc(pulled, Blocks(range(10, 17)), 100)
    assert de.hit_sources(pulled, 100) == {CacheHitSource.P2P: 100}
    for locality, source in (("LOCAL", CacheHitSource.DISK), ("REMOTE", CacheHitSource.EXTERNAL_UNSPECIFIED)):
        scheduler, store = make_scheduler(tmp_path, kv_events_locality=locality)
        prompt = prompt_of(3 * CHUNK + 7)
        store_chunks(store, prompt, 2)
        request = make_request("r1", prompt)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
        scheduler.update_state_after_alloc(request, Blocks(range(100, 104)), 2 * CHUNK)
        assert scheduler.hit_sources(request, 2 * CHUNK) == {source: 2 * CHUNK}
        assert scheduler.hit_sources(request, 0) == {}


def test_de_pull_skips_blocks_of_a_local_prefix_hit(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    request = make_request("d1", prompt_of(100), handoff().to_dict())

    assert scheduler.get_num_new_matched_tokens(request, 2 * BLOCK) == (100 - 2 * BLOCK, True)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100 - 2 * BLOCK)
    pull = scheduler.build_connector_meta(empty_step()).pulls[0]

    assert (pull.remote_block_ids, pull.block_ids) == ([502, 503, 504, 505, 506], [12, 13, 14, 15, 16])


def test_de_pull_with_too_few_remote_blocks_names_none(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    request = make_request("d1", prompt_of(100), handoff(num_remote_blocks=5).to_dict())

    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100)
    pull = scheduler.build_connector_meta(empty_step()).pulls[0]

    # Local blocks without remote ones: the worker fails them and vLLM recomputes.
    assert pull.remote_block_ids == []
    assert pull.block_ids == list(range(10, 17))


def kept_handoff(first_chunk=0, chunks=2, token="ab" * 16) -> PrefillHandoff:
    return PrefillHandoff(
        "pe-host:7001", "pe-r1", [500 + i for i in range(7)], stored_chunks=3,
        kept_token=token, kept_first_chunk=first_chunk, kept_chunks=chunks, hold_token=HOLD_TOKEN,
    )  # fmt: skip


def test_de_takes_the_kept_hit_chunks_and_pulls_the_rest(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    prompt = prompt_of(100)
    request = make_request("d1", prompt, kept_handoff().to_dict())

    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100)
    pull = scheduler.build_connector_meta(empty_step()).pulls[0]

    # Every block is still named for the pull (the fallback if the DE no longer keeps the hit) ...
    assert (pull.remote_block_ids, pull.block_ids) == (list(range(500, 507)), list(range(10, 17)))
    # ... and chunks 0-1 come from the kept buffer, named by the hashes the DE computes itself.
    assert pull.kept_token == "ab" * 16
    assert pull.kept == [ChunkLoad(h, 0, b) for h, b in zip(hashes_of(prompt)[:2], [[10, 11], [12, 13]])]


def test_de_kept_chunks_skip_its_local_prefix_hit(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    prompt = prompt_of(100)
    request = make_request("d1", prompt, kept_handoff(first_chunk=0, chunks=3).to_dict())

    # Three blocks local: chunk 0 is whole here, chunk 1 half.
    scheduler.get_num_new_matched_tokens(request, 3 * BLOCK)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100 - 3 * BLOCK)
    pull = scheduler.build_connector_meta(empty_step()).pulls[0]

    assert pull.block_ids == [13, 14, 15, 16]
    assert pull.kept == [ChunkLoad(hashes_of(prompt)[1], 1, [13]), ChunkLoad(hashes_of(prompt)[2], 0, [14, 15])]


@pytest.mark.parametrize("first_chunk, chunks", [(2, 10**9), (10**9, 5), (3, 1)])
def test_de_kept_range_is_clipped_to_the_prompt(tmp_path, first_chunk, chunks):
    """A hand-off naming chunks past the prompt (a bug or a forgery) yields at most the prompt's own chunks."""
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    prompt = prompt_of(100)  # chunks 0-2 are whole
    request = make_request("d1", prompt, kept_handoff(first_chunk, chunks).to_dict())
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100)
    pull = scheduler.build_connector_meta(empty_step()).pulls[0]

    expected = [ChunkLoad(hashes_of(prompt)[2], 0, [14, 15])] if first_chunk == 2 else []
    assert pull.kept == expected
    assert pull.kept_token == ("ab" * 16 if expected else None)


def test_de_without_usable_remote_blocks_uses_no_kept_chunk(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    params = {**kept_handoff().to_dict(), "remote_block_ids": [500, 501]}
    request = make_request("d1", prompt_of(100), params)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100)
    pull = scheduler.build_connector_meta(empty_step()).pulls[0]
    # The PE's answer is unusable: the whole prompt is recomputed, nothing half-copied.
    assert (pull.remote_block_ids, pull.kept, pull.kept_token) == ([], [], None)


def test_a_pe_side_read_may_move_to_the_decoding_de_and_be_kept_there(tmp_path):
    scheduler, store = make_scheduler(tmp_path, "kv_producer")
    prompt = prompt_of(100)
    store_chunks(store, prompt, 2)
    request = make_request("p1", prompt, PrefillRequest(read_side="pe", de_side_channel="h:1").to_dict())
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([40, 41, 42, 43]), 2 * CHUNK)
    load = scheduler.build_connector_meta(empty_step()).loads[0]
    assert (load.read_side, load.de_side_channel) == ("pe", "h:1") and load.keep_token
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = scheduler.request_finished(request, list(range(40, 47)))
    # Named in the hand-off either way: the DE finds nothing kept if this engine read the hit itself.
    assert PrefillHandoff.from_dict(params).kept_token == load.keep_token


def test_pe_reading_its_hit_itself_names_nothing_kept(tmp_path):
    scheduler, store = make_scheduler(tmp_path, "kv_producer")
    prompt = prompt_of(100)
    store_chunks(store, prompt, 2)
    request = make_request("p1", prompt, PrefillRequest(read_side="pe").to_dict())
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([40, 41, 42, 43]), 2 * CHUNK)
    assert scheduler.build_connector_meta(empty_step()).loads[0].keep_token is None
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = scheduler.request_finished(request, list(range(40, 47)))
    assert "kept_token" not in params


def test_de_saves_the_chunks_the_pe_did_not_find_stored(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    prompt = prompt_of(100)
    request = make_request("d1", prompt, handoff(stored_chunks=1).to_dict())
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100)
    scheduler.build_connector_meta(empty_step())

    # After the pull vLLM recomputes the last prompt token.
    meta = scheduler.build_connector_meta(step(new=[new_req("d1", range(10, 17), 99)], scheduled={"d1": 1}))
    assert meta.saves == [SaveSpec("d1", hashes_of(prompt)[1:3], [[12, 13], [14, 15]])]
    request.status = RequestStatus.FINISHED_STOPPED
    assert scheduler.request_finished(request, list(range(10, 17))) == (False, None)


# -- 7. prefill engine: hand-off -------------------------------------------------


def test_pe_hands_its_prefill_to_the_de(tmp_path):
    scheduler, store = make_scheduler(tmp_path, "kv_producer")
    prompt = prompt_of(100)
    store_chunks(store, prompt, 2)
    request = make_request("p1", prompt, PrefillRequest(read_side="de", de_side_channel="h:1").to_dict())

    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks([40, 41, 42, 43]), 2 * CHUNK)
    load = scheduler.build_connector_meta(empty_step()).loads[0]
    assert (load.read_side, load.de_side_channel) == ("de", "h:1")
    assert [c.chunk_hash for c in load.chunks] == hashes_of(prompt)[:2]
    # The DE that reads the hit keeps it for its decode, under a fresh token.
    assert load.keep_token and len(load.keep_token) == 32

    # The PE saves the prompt chunk it computed (chunk 2) through its own link.
    blocks = list(range(40, 47))
    meta = scheduler.build_connector_meta(step(new=[new_req("p1", blocks, 2 * CHUNK)], scheduled={"p1": 36}))
    assert meta.saves == [SaveSpec("p1", hashes_of(prompt)[2:3], [[44, 45]])]

    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    before = time.time()
    delay_free, params = scheduler.request_finished(request, blocks)
    assert delay_free is True
    # The DE saves only after chunk 3 (the PE's own saves included), and takes chunks 0-1 from what it keeps.
    parsed = PrefillHandoff.from_dict(params)
    assert parsed == PrefillHandoff(
        f"127.0.0.1:{PORT}", "p1", blocks, stored_chunks=3, kept_token=load.keep_token, kept_first_chunk=0,
        kept_chunks=2, hold_token=parsed.hold_token,
    )  # fmt: skip

    meta = scheduler.build_connector_meta(empty_step())
    assert [s.req_id for s in meta.sends] == ["p1"]
    # The hold ends only with the hand-off's secret; each hand-off gets its own.
    assert meta.sends[0].hold_token == parsed.hold_token and len(parsed.hold_token) == 32
    assert meta.sends[0].block_ids == blocks  # a push hand-off's claim names them
    assert before + 120.0 <= meta.sends[0].expires_at <= time.time() + 120.0
    assert "p1" in meta.dropped_req_ids


def test_pe_hands_off_a_prefill_asked_for_in_nixl_connector_convention(tmp_path):
    """A proxy that knows only NixlConnector's keys (no version, no DE named): a PE-side read, and the hand-off
    in the answer's params, which the proxy gives the decode request as they are."""
    scheduler, store = make_scheduler(tmp_path, "kv_producer")
    prompt = prompt_of(100)
    store_chunks(store, prompt, 2)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    request = make_request("p1", prompt, params)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks([40, 41, 42, 43]), 2 * CHUNK)
    load = scheduler.build_connector_meta(empty_step()).loads[0]
    assert (load.read_side, load.de_side_channel, load.keep_token) == ("pe", None, None)
    blocks = list(range(40, 47))
    scheduler.build_connector_meta(step(new=[new_req("p1", blocks, 2 * CHUNK)], scheduled={"p1": 36}))
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, handed = scheduler.request_finished(request, blocks)
    assert delay_free is True
    parsed = PrefillHandoff.from_dict(handed)
    assert parsed == PrefillHandoff(f"127.0.0.1:{PORT}", "p1", blocks, stored_chunks=3, hold_token=parsed.hold_token)


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_pe_hands_nothing_off_for_an_unfinished_prefill(tmp_path, status):
    scheduler, _ = make_scheduler(tmp_path, "kv_producer")
    request = make_request("p1", prompt_of(100), PrefillRequest().to_dict())
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)

    request.status = status
    assert scheduler.request_finished(request, list(range(7))) == (False, None)
    assert scheduler.build_connector_meta(empty_step()).sends == []


def test_pe_request_without_remote_decode_saves_itself(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_producer")
    prompt = prompt_of(100)
    request = make_request("p1", prompt)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)

    meta = scheduler.build_connector_meta(step(new=[new_req("p1", range(7))], scheduled={"p1": 100}))
    assert [s.chunk_hashes for s in meta.saves] == [hashes_of(prompt)[:3]]
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert scheduler.request_finished(request, list(range(7))) == (False, None)


# -- 8. protocol hardening -----------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {**PrefillRequest(read_side="de", de_side_channel="h:1").to_dict(), VERSION_KEY: 99},
        {**PrefillRequest().to_dict(), "read_side": "everywhere"},
        {**PrefillRequest().to_dict(), "read_side": "de", "de_side_channel": ""},
    ],
    ids=["other-version", "bad-read-side", "de-without-channel"],
)
def test_pe_ignores_unusable_prefill_requests(tmp_path, params):
    scheduler, store = make_scheduler(tmp_path, "kv_producer")
    prompt = prompt_of(100)
    store_chunks(store, prompt, 1)
    request = make_request("p1", prompt, params)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks([0, 1]), CHUNK)
    load = scheduler.build_connector_meta(empty_step()).loads[0]
    assert (load.read_side, load.de_side_channel) == ("pe", None)

    # Served as a plain request: it saves its own chunks and hands nothing off.
    meta = scheduler.build_connector_meta(step(new=[new_req("p1", range(7), CHUNK)], scheduled={"p1": 68}))
    assert [s.chunk_hashes for s in meta.saves] == [hashes_of(prompt)[1:3]]
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert scheduler.request_finished(request, list(range(7))) == (False, None)


# What vLLM's push-mode proxy (toy_push_proxy_server.py) sends a DE, copied from our PE's answer: the PE's
# coordinates, no blocks, no hold token, no version.
PUSH_MODE_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
                    "remote_request_id": handoff().remote_request_id, "remote_host": "pe-host", "remote_port": 7001,
                    "tp_size": 1}  # fmt: skip


def test_a_push_mode_handoff_is_pulled_with_the_blocks_its_claim_names(tmp_path, caplog):
    scheduler, store = make_scheduler(tmp_path, "kv_consumer")
    request = make_request("d1", prompt_of(100), PUSH_MODE_PARAMS)
    with caplog.at_level("INFO"):
        # Two leading blocks are in the local prefix cache: the pull starts after them.
        assert scheduler.get_num_new_matched_tokens(request, 2 * BLOCK) == (100 - 2 * BLOCK, True)
    assert "a push-mode proxy's hand-off" in caplog.text and "ignoring kv_transfer_params" not in caplog.text
    assert store.calls == []  # the PE prefilled it: no lookup
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 100 - 2 * BLOCK)
    meta = scheduler.build_connector_meta(empty_step())
    assert meta.pulls == [PullSpec("d1", "pe-host:7001", "pe-r1", "", None, [12, 13, 14, 15, 16], remote_first_block=2)]
    assert meta.loads == []


def test_an_aborted_push_mode_request_still_ends_the_pes_hold(tmp_path):
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer")
    request = make_request("d1", prompt_of(100), PUSH_MODE_PARAMS)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (100, True)
    request.status = RequestStatus.FINISHED_ABORTED
    assert scheduler.request_finished(request, []) == (False, None)
    # No token here: the worker claims the hold by request id and ends it with the claim's token.
    assert scheduler.build_connector_meta(empty_step()).pulls == [PullSpec("d1", "pe-host:7001", "pe-r1", "", [], [])]


@pytest.mark.parametrize(
    "params",
    [
        {**handoff().to_dict(), VERSION_KEY: 99},
        {**handoff().to_dict(), "remote_block_ids": "1,2,3"},
        {**handoff().to_dict(), "stored_chunks": -1},
        {**handoff().to_dict(), "remote_side_channel": None, "remote_host": None, "remote_port": None},
        {**handoff().to_dict(), "tp_size": 0},
        {**handoff().to_dict(), "tp_size": 2},
        # A push-mode proxy in front of a PE whose answer had no remote_host/remote_port (an older release).
        {**PUSH_MODE_PARAMS, "remote_host": None, "remote_port": None},
    ],
    ids=["other-version", "bad-blocks", "bad-stored-chunks", "no-side-channel", "bad-tp-size", "pe-of-another-tp-size",
         "push-mode-without-address"],
)
def test_de_ignores_unusable_handoffs_and_looks_up_the_store(tmp_path, params):
    scheduler, store = make_scheduler(tmp_path, "kv_consumer")
    prompt = prompt_of(100)
    store_chunks(store, prompt, 2)
    request = make_request("d1", prompt, params)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    assert store.calls == [keys_of(prompt)[:3]]
    scheduler.update_state_after_alloc(request, Blocks(range(4)), 2 * CHUNK)
    meta = scheduler.build_connector_meta(empty_step())
    assert meta.pulls == []
    assert len(meta.loads) == 1


# -- 9. failed-load retries ----------------------------------------------------


def test_failed_loads_are_retried_from_the_store_then_given_up(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(100)
    keys = keys_of(prompt)[:3]
    store_chunks(store, prompt, 3)
    request = make_request("r1", prompt)

    for attempt in range(MAX_LOAD_ATTEMPTS):
        # Each ask goes to the store itself, even though the first answer was
        # remembered: after a failed load the remembered answer is suspect.
        assert scheduler.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, True)
        assert store.calls == [keys] * (attempt + 1)
        scheduler.update_state_after_alloc(request, Blocks(range(6)), 3 * CHUNK)
        assert len(scheduler.build_connector_meta(empty_step()).loads) == 1

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert len(store.calls) == MAX_LOAD_ATTEMPTS
    scheduler.update_state_after_alloc(request, Blocks(range(7)), 0)
    assert scheduler.build_connector_meta(empty_step()).loads == []


def test_an_unallocated_hit_is_no_load_attempt(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(100)
    store_chunks(store, prompt, 3)
    request = make_request("r1", prompt)

    # vLLM could not allocate blocks: it asks again next step, many times.
    for _ in range(MAX_LOAD_ATTEMPTS + 1):
        assert scheduler.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, True)
    assert len(store.calls) == 1  # the cache answered the repeats


def test_chunks_missing_on_a_retry_are_saved_again(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(100)
    keys = keys_of(prompt)
    store_chunks(store, prompt, 3)
    request = make_request("r1", prompt)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (3 * CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks(range(6)), 3 * CHUNK)
    scheduler.build_connector_meta(empty_step())

    # The load of chunk 2 failed: it is gone from the store (lifecycle rule).
    store.present.discard(keys[2])
    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks(range(4)), 2 * CHUNK)
    scheduler.build_connector_meta(empty_step())

    # vLLM recomputes chunk 2 from the store's answer: it must be written back.
    meta = scheduler.build_connector_meta(step(new=[new_req("r1", range(7), 2 * CHUNK)], scheduled={"r1": 36}))
    assert meta.saves == [SaveSpec("r1", [hashes_of(prompt)[2]], [[4, 5]], only_missing=True)]


# -- 10. salts, adapters, uncacheable requests ---------------------------------


LORA_A = SimpleNamespace(lora_name="adapter-a", lora_path="/adapters/a", lora_int_id=1)


def chain_keys(tokens: list[int], **isolation) -> list[str]:
    chain = isolated_chain(NAMESPACE.digest(), **isolation)
    return [chunk_key(KEY_PREFIX, NAMESPACE.digest(), h) for h in chunk_hashes(chain, tokens, CHUNK)]


@pytest.mark.parametrize(
    "override, isolation",
    [
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}),
        ({"lora_request": LORA_A}, {"lora": ("adapter-a", "/adapters/a")}),
    ],
    ids=["cache-salt", "lora"],
)
def test_salted_and_adapter_requests_hit_and_save_in_their_own_chain(tmp_path, override, isolation):
    """The same tokens under a salt or an adapter: other keys; the plain chain's chunks are no hit for them."""
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(100)
    own = chain_keys(prompt, **isolation)
    assert not set(own) & set(keys_of(prompt))
    store_chunks(store, prompt, 3)  # the plain chain: not theirs
    request = make_request("r1", prompt, **override)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert store.calls and set(store.calls[-1]) <= set(own)
    scheduler.update_state_after_alloc(request, Blocks([]), 0)
    meta = scheduler.build_connector_meta(step(new=[new_req("r1", range(7))], scheduled={"r1": 100}))
    assert [scheduler._lookup_keys.key(h) for h in meta.saves[0].chunk_hashes] == own

    store.present.update(own[:2])
    again = make_request("r2", prompt, **override)
    assert scheduler.get_num_new_matched_tokens(again, 0) == (2 * CHUNK, True)
    other = make_request("r3", prompt, cache_salt="tenant-b", lora_request=None)
    assert scheduler.get_num_new_matched_tokens(other, 0) == (0, False)


def test_chains_differ_by_salt_adapter_and_their_spelling():
    """No two isolations share a chain; the plain one is the namespace itself (keys of plain requests unchanged)."""
    digest = NAMESPACE.digest()
    chains = [
        isolated_chain(digest, cache_salt="a"), isolated_chain(digest, cache_salt="b"),
        isolated_chain(digest, lora=("x", "/p")), isolated_chain(digest, lora=("x", "/q")),
        isolated_chain(digest, lora=("x/", "p")), isolated_chain(digest, cache_salt="a", lora=("x", "/p")),
    ]  # fmt: skip
    assert len(set(chains)) == len(chains) and digest not in chains
    assert isolated_chain(digest) == isolated_chain(digest, cache_salt="") == digest


@pytest.mark.parametrize(
    "override",
    [{"mm_features": [SimpleNamespace(identifier="img")]}, {"prompt_embeds": SimpleNamespace(shape=(100, 8))}],
    ids=["multimodal", "prompt-embeds"],
)
def test_uncacheable_requests_neither_hit_nor_save(tmp_path, override):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(100)
    store_chunks(store, prompt, 3)
    request = make_request("r1", prompt, **override)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert store.calls == []
    scheduler.update_state_after_alloc(request, Blocks([]), 0)
    meta = scheduler.build_connector_meta(step(new=[new_req("r1", range(7))], scheduled={"r1": 100}))
    assert meta.saves == [] and meta.loads == []
    meta = scheduler.build_connector_meta(step(cached_reqs=[cached("r1", 100, [7])], scheduled={"r1": 1}))
    assert meta.saves == []


def test_pe_hands_off_an_uncacheable_prefill_without_touching_the_store(tmp_path):
    scheduler, store = make_scheduler(tmp_path, "kv_producer")
    request = make_request("p1", prompt_of(100), PrefillRequest().to_dict(), mm_features=[SimpleNamespace(identifier="i")])

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert store.calls == []
    scheduler.update_state_after_alloc(request, Blocks([]), 0)
    meta = scheduler.build_connector_meta(step(new=[new_req("p1", range(7))], scheduled={"p1": 100}))
    assert meta.saves == []

    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, params = scheduler.request_finished(request, list(range(7)))
    assert delay_free is True
    parsed = PrefillHandoff.from_dict(params)
    assert parsed == PrefillHandoff(f"127.0.0.1:{PORT}", "p1", list(range(7)), 0, hold_token=parsed.hold_token)


# -- 11. store outage ----------------------------------------------------------


def test_a_store_outage_is_a_miss_not_an_error(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(100)
    store_chunks(store, prompt, 3)
    store.down = True
    request = make_request("r1", prompt)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert len(store.calls) == 1
    scheduler.update_state_after_alloc(request, Blocks([]), 0)
    assert scheduler.build_connector_meta(empty_step()).loads == []

    # The store is back: the next request finds the hit.
    store.down = False
    assert scheduler.get_num_new_matched_tokens(make_request("r2", prompt), 0) == (3 * CHUNK, True)


# -- 12. lookup cache ----------------------------------------------------------


class Clock:
    """Monotonic seconds the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_chunks_known_present_are_not_looked_up_again(tmp_path):
    clock = Clock()
    scheduler, store = make_scheduler(tmp_path, clock=clock)
    prompt = prompt_of(100)
    keys = keys_of(prompt)
    store_chunks(store, prompt, 2)

    assert scheduler.get_num_new_matched_tokens(make_request("r1", prompt), 0) == (2 * CHUNK, True)
    assert store.calls == [keys[:3]]

    # Same prefix, longer prompt, once the remembered miss (chunk 2) expired: only the keys past the known run
    # go to the store.
    clock.now += scheduler.config.lookup_absent_ttl_s
    longer = prompt + prompt_of(64, seed=2)
    longer_keys = keys_of(longer)
    assert longer_keys[:3] == keys[:3]
    assert scheduler.get_num_new_matched_tokens(make_request("r2", longer), 0) == (2 * CHUNK, True)
    assert store.calls[1] == longer_keys[2:5]

    # Everything claimable known present: no store round trip at all.
    store_chunks(store, prompt, 3)
    clock.now += scheduler.config.lookup_absent_ttl_s
    scheduler.get_num_new_matched_tokens(make_request("r3", prompt), 0)
    assert store.calls[2] == keys[2:3]
    assert scheduler.get_num_new_matched_tokens(make_request("r4", prompt), 0) == (3 * CHUNK, True)
    assert len(store.calls) == 3


def test_a_miss_is_remembered_for_lookup_absent_ttl_s(tmp_path):
    clock = Clock()
    scheduler, store = make_scheduler(tmp_path, clock=clock, lookup_absent_ttl_s=2.0)
    prompt = prompt_of(100)
    assert scheduler.get_num_new_matched_tokens(make_request("r1", prompt), 0) == (0, False)
    store_chunks(store, prompt, 3)
    # Within the TTL the remembered miss answers, without the store.
    clock.now += 1.9
    assert scheduler.get_num_new_matched_tokens(make_request("r2", prompt), 0) == (0, False)
    assert len(store.calls) == 1
    # Negative control: once it expired the store is asked and the chunks saved meanwhile are found.
    clock.now += 0.1
    assert scheduler.get_num_new_matched_tokens(make_request("r3", prompt), 0) == (3 * CHUNK, True)
    assert len(store.calls) == 2


def test_a_save_planned_here_forgets_the_remembered_miss(tmp_path):
    """The chunks this engine saves are looked up afresh at once: the next turn finds them when they landed."""
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(3 * CHUNK + 5)
    request = make_request("r1", prompt)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 17)), 0)
    meta = scheduler.build_connector_meta(step(new=[new_req("r1", range(10, 17))], scheduled={"r1": len(prompt)}))
    assert [len(save.chunk_hashes) for save in meta.saves] == [3]
    store_chunks(store, prompt, 3)  # the save landed
    assert scheduler.get_num_new_matched_tokens(make_request("r2", prompt), 0) == (3 * CHUNK, True)


# -- bookkeeping ---------------------------------------------------------------


def test_finished_requests_are_dropped_and_forgotten(tmp_path):
    scheduler, _ = make_scheduler(tmp_path)
    request = make_request("r1", prompt_of(100))
    scheduler.get_num_new_matched_tokens(request, 0)
    request.status = RequestStatus.FINISHED_STOPPED
    assert scheduler.request_finished(request, [0, 1]) == (False, None)
    # A request the scheduler never saw is dropped too.
    assert scheduler.request_finished(make_request("r2", prompt_of(10)), []) == (False, None)

    meta = scheduler.build_connector_meta(step(cached_reqs=[cached("r1", 100)], scheduled={"r1": 1}))
    assert meta.dropped_req_ids == ["r1", "r2"]
    assert meta.saves == []
    assert scheduler.build_connector_meta(empty_step()).dropped_req_ids == []


def test_shutdown_closes_the_store(tmp_path):
    scheduler, store = make_scheduler(tmp_path)
    scheduler.shutdown()
    assert store.closed


def test_chunks_failed_mid_forward_are_saved_again_as_recomputed(tmp_path):
    """A running request's hit fails from chunk 1 on mid-forward (a late or bad layer): vLLM rolls it back
    and never asks again, so the failed blocks reported to the scheduler reopen those chunks' saves and
    drop them from the lookup cache."""
    scheduler, store = make_scheduler(tmp_path)
    prompt = prompt_of(4 * CHUNK + 22)
    hashes, keys = hashes_of(prompt), keys_of(prompt)
    store_chunks(store, prompt, 4)
    request = make_request("r1", prompt)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (4 * CHUNK, True)
    scheduler.update_state_after_alloc(request, Blocks(range(10, 20)), 4 * CHUNK)
    scheduler.build_connector_meta(empty_step())
    lookups = len(store.calls)

    # Nothing the scheduler knows about: no change.
    scheduler.update_connector_output({999})
    # Chunk 1's second block failed: vLLM recomputes from token 32 (chunked: 32..95 first).
    scheduler.update_connector_output({13})
    meta = scheduler.build_connector_meta(step(cached_reqs=[cached("r1", CHUNK)], scheduled={"r1": 2 * CHUNK}))
    # Written only where the store lacks them: the rest keep the bytes every earlier hit read.
    assert meta.saves == [SaveSpec("r1", hashes[1:3], [[12, 13], [14, 15]], only_missing=True)]
    # The lookup cache forgot chunks 1..: another request's lookup asks the store again.
    store.present.discard(keys[1])
    assert scheduler.get_num_new_matched_tokens(make_request("r2", prompt), 0) == (CHUNK, True)
    assert len(store.calls) == lookups + 1


# -- multi-turn D->P reuse (vLLM's disagg_proxy_multiturn.py) ---------------------------


def finished_decode(tmp_path, retain_s=30.0, turn=None, computed_all=False):
    """A DE that decoded ``turn`` (prompt + output, every token's KV computed but the last's, or, ``computed_all``,
    counted as computed too): its answer's params."""
    scheduler, _ = make_scheduler(tmp_path, "kv_consumer", pd_retain_decode_s=retain_s)
    turn = turn or prompt_of(5 * CHUNK + 9)
    request = make_request("d1", turn[:-20], handoff(num_remote_blocks=9).to_dict())
    matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, Blocks(range(100, 109)), matched)
    scheduler.build_connector_meta(empty_step())  # the prompt's pull
    request.all_token_ids, request.num_tokens = list(turn), len(turn)
    request.num_computed_tokens = len(turn) - (0 if computed_all else 1)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return scheduler, scheduler.request_finished(request, list(range(100, 111)))


def test_a_de_retains_a_finished_decode_naming_its_blocks_and_the_chain_at_its_last_chunks(tmp_path):
    turn = prompt_of(5 * CHUNK + 9)
    scheduler, (delay_free, params) = finished_decode(tmp_path, turn=turn)
    assert delay_free is True
    retained = RetainedDecode.from_dict(params)
    assert (retained.remote_side_channel, retained.remote_block_ids, retained.retained_tokens) == (
        f"127.0.0.1:{PORT}", list(range(100, 111)), len(turn) - 1)
    # The hash chain of the conversation's tokens at its last full chunks, most first.
    assert retained.checkpoints == [(n, hashes_of(turn)[n - 1]) for n in (5, 4, 3, 2)]
    send = scheduler.build_connector_meta(empty_step()).sends[0]
    assert (send.hold_token, send.block_ids, send.retained) == (retained.hold_token, list(range(100, 111)), True)
    # Control: off (the default), the DE answers nothing and frees its blocks.
    assert finished_decode(tmp_path, retain_s=0.0)[1] == (False, None)
    # Never the last sampled token's KV, which no step computed, whatever the count says.
    assert RetainedDecode.from_dict(finished_decode(tmp_path, computed_all=True)[1][1]).retained_tokens == len(turn) - 1


def next_turn(tmp_path, params, prompt, num_computed=0):
    """The next turn's PE, asked with the proxy's params (the DE's answer, do_remote_decode true)."""
    scheduler, store = make_scheduler(tmp_path, "kv_producer")
    request = make_request("p2", prompt, {**params, "do_remote_decode": True, "do_remote_prefill": False})
    return scheduler, store, request, scheduler.get_num_new_matched_tokens(request, num_computed)


def test_the_next_turns_pe_pulls_the_matching_chunks_from_the_de_and_asks_no_store(tmp_path):
    turn = prompt_of(5 * CHUNK + 9)
    _, (_, params) = finished_decode(tmp_path, turn=turn)
    prompt = turn + prompt_of(40, seed=7)
    scheduler, store, request, matched = next_turn(tmp_path, params, prompt, num_computed=BLOCK)
    assert matched == (5 * CHUNK - BLOCK, True) and store.calls == []
    scheduler.update_state_after_alloc(request, Blocks(range(20, 34)), 5 * CHUNK - BLOCK)
    pull = scheduler.build_connector_meta(empty_step()).pulls[0]
    # The DE's blocks 1-9 (block 0 is in the local prefix cache) into this request's.
    assert (pull.remote_side_channel, pull.remote_block_ids, pull.block_ids) == (
        f"127.0.0.1:{PORT}", list(range(101, 110)), list(range(21, 30)))
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert scheduler.hit_sources(request, 5 * CHUNK - BLOCK) == {CacheHitSource.P2P: 5 * CHUNK - BLOCK}
    # Asked again (the pull failed), it asks the store instead of pulling again.
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False) and store.calls


def test_a_next_turn_that_rewrote_the_last_chunk_pulls_up_to_the_one_before(tmp_path):
    turn = prompt_of(5 * CHUNK + 9)
    _, (_, params) = finished_decode(tmp_path, turn=turn)
    rerendered = turn[: 4 * CHUNK + 3] + [7] + turn[4 * CHUNK + 4 :]  # a token of chunk 5 differs
    assert next_turn(tmp_path, params, rerendered)[3] == (4 * CHUNK, True)


@pytest.mark.parametrize("change", ["other tokens", "other tp"])
def test_a_retained_decode_of_other_tokens_is_never_pulled_and_its_hold_ends(tmp_path, change):
    _, (_, params) = finished_decode(tmp_path)
    prompt = prompt_of(6 * CHUNK, seed=3)  # another conversation
    if change == "other tp":
        prompt, params = prompt_of(5 * CHUNK + 9) + [1] * 40, {**params, "tp_size": 2}
    scheduler, store, request, matched = next_turn(tmp_path, params, prompt)
    assert matched == (0, False) and store.calls  # the store's hit instead (none here)
    pulls = scheduler.build_connector_meta(empty_step()).pulls
    if change == "other tokens":  # released at once; a DE of another size is left to its expiry
        assert [(p.remote_req_id, p.block_ids, p.remote_block_ids) for p in pulls] == [("d1", [], [])]
    else:
        assert pulls == []
