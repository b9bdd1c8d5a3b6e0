"""Store lookups never block vLLM's scheduler: the lookup lane alone, then vLLM's own ``Scheduler`` with our connector.

The store is a fake whose ``lookup`` waits on a gate the test opens (a store that answers late, without a
sleep): while it waits, ``get_num_new_matched_tokens`` answers ``None`` and vLLM keeps scheduling the
other requests; once the answer is in, the request is scheduled with it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from dualpath_connector.scheduler.lookup_lane import LookupLane
from nixl_backends.lookup import PresentChunks
from tests.unit.test_scheduler import FakeStore, InlineExecutor

WAIT_S = 30.0  # a bound on waits for the lane's thread, never a synchronization by time
BLOCK = 32


class GatedStore(FakeStore):
    """test_scheduler's FakeStore (``down`` raises) whose ``lookup`` answers once ``gate`` is open; records the
    asking thread."""

    def __init__(self, present: set[str] = frozenset(), fail: bool = False) -> None:
        super().__init__()
        self.present = set(present)
        self.down = fail
        self.gate = threading.Event()
        self.threads: list[int] = []

    def lookup(self, keys):
        self.threads.append(threading.get_ident())
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().lookup(keys)


KEYS = [f"k{i}" for i in range(4)]


@pytest.fixture
def lane():
    present = PresentChunks(100, absent_ttl_s=60.0)
    store = GatedStore({"k0", "k1"})
    lane = LookupLane(present, lambda: store)
    lane.store = store
    yield lane
    store.gate.set()
    lane.close()


def _collect(lane: LookupLane, request_id: str) -> None:
    future = lane.in_flight(request_id)
    assert future is not None
    future.exception(timeout=WAIT_S)  # returns once the lookup ended, whatever its outcome


def test_a_lookup_runs_off_the_calling_thread_and_is_answered_later(lane):
    assert lane.answer("r1", KEYS) is None
    assert lane.answer("r1", KEYS) is None  # still in flight: no second lookup
    lane.store.gate.set()
    _collect(lane, "r1")
    assert lane.answer("r1", KEYS) == 2
    assert lane.store.threads and threading.get_ident() not in lane.store.threads
    assert len(lane.store.threads) == 1
    # Another request with the same prefix: settled by the remembered answers (k2 absent), no store round trip.
    assert lane.answer("r2", KEYS) == 2
    assert len(lane.store.threads) == 1


def test_a_store_error_is_raised_once_and_not_remembered():
    store = GatedStore(fail=True)
    lane = LookupLane(PresentChunks(100, absent_ttl_s=60.0), lambda: store)
    try:
        assert lane.answer("r1", KEYS) is None
        store.gate.set()
        _collect(lane, "r1")
        with pytest.raises(ConnectionError):
            lane.answer("r1", KEYS)
        store.down = False
        assert lane.answer("r1", KEYS) is None  # asked again, not answered from a remembered failure
        _collect(lane, "r1")
        assert lane.answer("r1", KEYS) == 0
    finally:
        lane.close()


def test_other_keys_for_a_request_start_a_new_lookup_and_drop_forgets_it(lane):
    assert lane.answer("r1", KEYS[:2]) is None
    first = lane.in_flight("r1")
    assert lane.answer("r1", KEYS) is None  # the request grew: the old answer is of no use
    assert lane.in_flight("r1") is not first
    lane.drop("r1")
    assert lane.in_flight("r1") is None


def test_not_in_background_the_caller_waits_for_the_answer(lane):
    """An idle engine: the lookup runs in the calling thread, and one already running is waited for."""
    lane.store.gate.set()
    assert lane.answer("r1", KEYS, background=False) == 2
    assert lane.store.threads == [threading.get_ident()]
    lane.store.gate.clear()
    assert lane.answer("r2", ["k9"]) is None  # started in the background while the engine was busy
    lane.store.gate.set()
    assert lane.answer("r2", ["k9"], background=False) == 0  # now idle: waited for, not asked again
    assert len(lane.store.threads) == 2


def test_an_inline_executor_answers_in_the_same_call():
    store = GatedStore({"k0"})
    store.gate.set()
    lane = LookupLane(PresentChunks(100), lambda: store, InlineExecutor())
    assert lane.answer("r1", KEYS) == 1
    assert store.threads == [threading.get_ident()]


# -- vLLM's own Scheduler with DualPathConnector ------------------------------------------------------------


def _scheduler(tiny_model, tmp_path, **extra) -> Scheduler:
    store = {"backend": "posix", "root": str(tmp_path)}
    kv = KVTransferConfig(kv_connector="DualPathConnector", kv_connector_module_path="dualpath_connector",
                          kv_role="kv_both", kv_connector_extra_config={"store": store, **extra})  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=8192, seed=0),  # fmt: skip
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=8192,
                                         is_encoder_decoder=False),  # fmt: skip
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        kv_transfer_config=kv,
    )
    config.cache_config.num_gpu_blocks = 1000
    kv_cache_config = KVCacheConfig(
        num_blocks=1000, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))],
    )  # fmt: skip
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)  # fmt: skip


def _request(req_id: str, length: int) -> Request:
    return Request(request_id=req_id, prompt_token_ids=[3 + i % 1000 for i in range(length)],
                   sampling_params=SamplingParams(max_tokens=64), pooling_params=None)  # fmt: skip


def _step(scheduler: Scheduler) -> dict[str, int]:
    """One engine step: schedule, the model's output (token 7 for every finished prefill), update."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens else []
               for r in ids]  # fmt: skip
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))  # fmt: skip
    return dict(output.num_scheduled_tokens)


def _gate_the_store(scheduler: Scheduler) -> GatedStore:
    connector_scheduler = scheduler.connector._scheduler
    store = GatedStore()
    connector_scheduler.store = store
    return store


def test_vllm_keeps_scheduling_a_decode_while_a_lookup_waits_on_the_store(tiny_model, tmp_path):
    scheduler = _scheduler(tiny_model, tmp_path)
    store = _gate_the_store(scheduler)
    try:
        # A prompt shorter than a chunk has nothing to look up: it is scheduled at once and decodes.
        scheduler.add_request(_request("decoding", BLOCK - 8))
        assert _step(scheduler) == {"decoding": BLOCK - 8}
        scheduler.add_request(_request("long", 40 * BLOCK))
        for _ in range(3):
            assert _step(scheduler) == {"decoding": 1}  # the long prompt waits for its lookup, the decode does not
        assert scheduler.requests["long"].status == RequestStatus.WAITING
        assert len(store.threads) == 1 and threading.get_ident() not in store.threads
        store.gate.set()
        lookup: Future = scheduler.connector._scheduler._lookups.in_flight("long")
        lookup.result(timeout=WAIT_S)
        # The answer is in (a miss): the prompt is scheduled beside the decode.
        assert _step(scheduler) == {"decoding": 1, "long": 40 * BLOCK}
    finally:
        store.gate.set()
        scheduler.shutdown()


def test_an_idle_engine_looks_up_on_the_scheduler_thread(tiny_model, tmp_path):
    """Nothing else to schedule: the lookup is waited for in the scheduler (vLLM would spin through empty steps)."""
    scheduler = _scheduler(tiny_model, tmp_path)
    store = _gate_the_store(scheduler)
    store.gate.set()
    try:
        scheduler.add_request(_request("long", 40 * BLOCK))
        assert _step(scheduler) == {"long": 40 * BLOCK}
        assert store.threads == [threading.get_ident()]
    finally:
        scheduler.shutdown()


def test_a_lookup_not_in_background_runs_on_the_scheduler_thread(tiny_model, tmp_path):
    """Negative control (``lookup_in_background: false``, what the connector did before): with a decode running,
    the store is asked on vLLM's scheduling thread, so the decode waits for it."""
    scheduler = _scheduler(tiny_model, tmp_path, lookup_in_background=False)
    store = _gate_the_store(scheduler)
    store.gate.set()
    try:
        scheduler.add_request(_request("decoding", BLOCK - 8))
        assert _step(scheduler) == {"decoding": BLOCK - 8}
        scheduler.add_request(_request("long", 40 * BLOCK))
        assert _step(scheduler) == {"decoding": 1, "long": 40 * BLOCK}
        assert store.threads == [threading.get_ident()]
    finally:
        scheduler.shutdown()
