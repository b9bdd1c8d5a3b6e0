"""The compute quota: the step-time model's fit, the binary search, its config, and the real vLLM
Scheduler subclass built in-process on CPU (no engine: steps are driven by hand)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from dualpath_connector.scheduler.compute_quota import (
    AsyncQuotaScheduler,
    QuotaScheduler,
    largest_fitting,
    parse_quota_config,
    quota_chunk,
)
from dualpath_connector.scheduler.step_time_model import StepRecorder, StepShape, StepTimeModel, attention_work
from nixl_backends.configuration import ConfigError

BLOCK = 32
# A step-time model with round numbers: 10 ms per step, 0.1 ms per prefill or decode token,
# 1e-8 s per query-key pair of attention.
COEFFICIENTS = [0.010, 1e-4, 1e-4, 1e-8]


def random_shapes(rng: np.random.Generator, count: int) -> list[StepShape]:
    shapes = []
    for _ in range(count):
        shape = StepShape()
        for _ in range(rng.integers(1, 6)):
            if rng.random() < 0.5:
                shape.add(int(rng.integers(0, 4000)), 1, decode=True)
            else:
                shape.add(int(rng.integers(0, 8000)), int(rng.integers(1, 2048)), decode=False)
        shapes.append(shape)
    return shapes


def test_fit_recovers_known_coefficients_and_can_fail():
    rng = np.random.default_rng(0)
    shapes = random_shapes(rng, 200)
    truth = StepTimeModel(COEFFICIENTS)
    seconds = [truth.predict(s) * (1 + rng.normal(0, 1e-4)) for s in shapes]
    model = StepTimeModel()
    model.fit(shapes, seconds)
    np.testing.assert_allclose(model.coefficients, COEFFICIENTS, rtol=0.02)
    # Negative control: times from another model (attention twice as dear) are not fitted as ours.
    other = StepTimeModel([0.010, 1e-4, 1e-4, 2e-8])
    model.fit(shapes, [other.predict(s) for s in shapes])
    assert not np.allclose(model.coefficients, COEFFICIENTS, rtol=0.02, atol=0)


def test_fit_keeps_coefficients_non_negative():
    # Decode tokens cost nothing here and the noise would make a plain fit slightly negative.
    rng = np.random.default_rng(1)
    shapes = random_shapes(rng, 100)
    truth = StepTimeModel([0.01, 1e-4, 0.0, 1e-8])
    seconds = [truth.predict(s) + rng.normal(0, 2e-3) for s in shapes]
    model = StepTimeModel()
    model.fit(shapes, seconds)
    assert np.all(model.coefficients >= 0)
    assert model.coefficients[3] == pytest.approx(1e-8, rel=0.1)


def test_recorder_refits_after_min_steps():
    rng = np.random.default_rng(2)
    truth = StepTimeModel(COEFFICIENTS)
    model = StepTimeModel()
    recorder = StepRecorder(model, window=64, min_steps=8, refit_every=4)
    shapes = random_shapes(rng, 8)
    for shape in shapes[:7]:
        assert not recorder.record(shape, truth.predict(shape))
    assert not model.fitted
    assert recorder.record(shapes[7], truth.predict(shapes[7]))
    assert model.fitted


def test_profile_round_trip_and_bad_profiles(tmp_path):
    path = tmp_path / "profile.json"
    StepTimeModel(COEFFICIENTS).save(path)
    assert list(StepTimeModel.load(path).coefficients) == COEFFICIENTS
    for text, reason in [
        ("{", "cannot read"),
        (json.dumps({"format": "other"}), "not a profile"),
        (json.dumps(dict(StepTimeModel(COEFFICIENTS).to_profile(), coefficients=[1, 2])), "4 numbers"),
        (json.dumps(dict(StepTimeModel(COEFFICIENTS).to_profile(), coefficients=[1, -1, 0, 0])), ">= 0"),
        (json.dumps(dict(StepTimeModel(COEFFICIENTS).to_profile(), coefficients=[1, "nan", 0, 0])), ">= 0"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=reason):
            StepTimeModel.load(path)


def test_largest_fitting_is_the_boundary():
    for limit in (0, 1, 7, 999, 1000):
        assert largest_fitting(lambda n: n <= limit, 1000) == limit
    assert largest_fitting(lambda n: n <= 5000, 1000) == 1000


def test_quota_chunk_is_the_largest_chunk_under_the_quota():
    model = StepTimeModel(COEFFICIENTS)
    step = StepShape()
    step.add(3000, 1, decode=True)  # a decode already in the step
    quota = 0.100
    chunk = quota_chunk(model, step, quota, context=2000, wanted=5000, floor=BLOCK)
    assert 0 < chunk < 5000
    assert model.predict(step.with_prefill(2000, chunk)) <= quota
    assert model.predict(step.with_prefill(2000, chunk + 1)) > quota
    # A prefill that fits whole is not cut; more context leaves room for fewer tokens.
    assert quota_chunk(model, step, quota, context=0, wanted=100, floor=BLOCK) == 100
    assert quota_chunk(model, step, quota, context=20000, wanted=5000, floor=BLOCK) < chunk


def test_quota_chunk_floor_when_nothing_fits():
    model = StepTimeModel(COEFFICIENTS)
    full = StepShape(decode_tokens=2000)  # 10 ms + 200 ms of decodes: over a 100 ms quota already
    assert quota_chunk(model, full, 0.100, context=0, wanted=5000, floor=BLOCK) == BLOCK
    assert quota_chunk(model, full, 0.100, context=0, wanted=10, floor=BLOCK) == 10
    assert quota_chunk(model, full, 0.100, context=0, wanted=5000, floor=None) == 0


def test_attention_work_counts_causal_pairs():
    assert attention_work(0, 4) == 8  # 1 + 2 + 3 + 4 = 10 exactly; n*n/2 is the continuous form
    assert attention_work(100, 1) == 100.5


@pytest.mark.parametrize("section, key", [
    ({"quota_ms": 0}, "quota_ms"),
    ({"quota_ms": "300"}, "quota_ms"),
    ({"floor_tokens": 0}, "floor_tokens"),
    ({"min_fit_steps": 2}, "min_fit_steps"),
    ({"min_fit_steps": 64, "fit_window_steps": 32}, "fit_window_steps"),
    ({"refit_every_steps": 0}, "refit_every_steps"),
    ({"ignore_first_steps": -1}, "ignore_first_steps"),
    ({"learn_online": False}, "learn_online"),
    ({"quota": 300}, "quota"),
])
def test_config_errors_name_the_key(section, key):
    with pytest.raises(ConfigError, match=f"additional_config.compute_quota.'?{key}"):
        parse_quota_config({"compute_quota": section})


def test_config_defaults_and_section_type():
    config = parse_quota_config({})
    assert (config.quota_ms, config.floor_tokens, config.profile) == (300.0, None, None)
    assert parse_quota_config({"compute_quota": {"quota_ms": 50}}).quota_ms == 50
    with pytest.raises(ConfigError, match="additional_config.compute_quota must be an object"):
        parse_quota_config({"compute_quota": 300})


# --- the real vLLM scheduler, in-process -------------------------------------------------------

@pytest.fixture(scope="module")
def make_vllm_config(tiny_model):
    def make(quota: dict | None = None, async_scheduling: bool = False) -> VllmConfig:
        config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model), skip_tokenizer_init=True, dtype="bfloat16",
                                     max_model_len=16384, seed=0),
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096,
                                             max_model_len=16384, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            additional_config={"compute_quota": quota} if quota is not None else {},
        )
        config.cache_config.num_gpu_blocks = 2000
        config.scheduler_config.async_scheduling = async_scheduling
        return config
    return make


def build(cls, vllm_config: VllmConfig):
    kv_cache_config = KVCacheConfig(
        num_blocks=2000, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))],
    )
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)


def request(req_id: str, length: int) -> Request:
    return Request(request_id=req_id, prompt_token_ids=[3 + i % 1000 for i in range(length)],
                   sampling_params=SamplingParams(max_tokens=64), pooling_params=None)


def step(scheduler, then_add=()) -> dict[str, int]:
    """One engine step: schedule, the model's output (token 7 for every finished prefill), update."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_prompt_tokens else []
               for r in ids]
    scheduler.update_from_output(output, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
    for r in then_add:
        scheduler.add_request(r)
    return dict(output.num_scheduled_tokens)


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "profile.json"
    StepTimeModel(COEFFICIENTS).save(path)
    return str(path)


def mixed_load(scheduler) -> list[dict[str, int]]:
    """A short request decoding; then a short and a long prompt arrive together (short first)."""
    scheduler.add_request(request("decoding", 200))
    steps = [step(scheduler, then_add=[request("short", 60), request("long", 6000)])]
    steps += [step(scheduler) for _ in range(3)]
    return steps


def test_quota_limits_the_long_prefill_and_schedules_shorts_and_decodes(make_vllm_config, profile):
    scheduler = build(QuotaScheduler, make_vllm_config({"quota_ms": 100, "profile": profile,
                                                        "learn_online": False}))
    steps = mixed_load(scheduler)
    # Step 2: the decode, the short prompt whole, and the long prompt's chunk under the quota.
    assert steps[1]["decoding"] == 1
    assert steps[1]["short"] == 60
    chunk = steps[1]["long"]
    model = StepTimeModel(COEFFICIENTS)
    planned = StepShape()
    planned.add(200, 1, decode=True)
    planned.add(0, 60, decode=False)
    assert model.predict(planned.with_prefill(0, chunk)) <= 0.100 < model.predict(planned.with_prefill(0, chunk + 1))
    # Later steps: decodes of both shorts every step; the long chunk shrinks as its context grows.
    for later in steps[2:]:
        assert later["decoding"] == 1 and later["short"] == 1
    assert steps[1]["long"] > steps[2]["long"] > steps[3]["long"] > BLOCK
    assert scheduler.quota_limited_steps == 3


def test_without_the_quota_the_long_prefill_takes_the_budget(make_vllm_config):
    # Negative control: vLLM's own Scheduler on the same load gives the long prompt the whole budget.
    steps = mixed_load(build(Scheduler, make_vllm_config()))
    assert steps[1] == {"decoding": 1, "short": 60, "long": 4096 - 61}


def test_floor_when_decodes_fill_the_quota(make_vllm_config, profile):
    # 10 ms per step + 0.1 ms per token: a 10 ms quota is full before any prefill.
    scheduler = build(QuotaScheduler, make_vllm_config({"quota_ms": 10, "profile": profile,
                                                        "learn_online": False}))
    scheduler.add_request(request("decoding", 200))
    # Alone, a prefill progresses by the floor (one block) per step.
    assert [step(scheduler) for _ in range(7)] == [{"decoding": BLOCK}] * 6 + [{"decoding": 200 - 6 * BLOCK}]
    scheduler.add_request(request("short", 60))
    scheduler.add_request(request("long", 6000))
    steps = [step(scheduler) for _ in range(3)]
    # The step's first prefill gets the floor, the ones after it nothing (FIFO); decodes always run.
    assert steps[0] == {"decoding": 1, "short": BLOCK}
    assert steps[1] == {"decoding": 1, "short": 60 - BLOCK}
    assert steps[2] == {"decoding": 1, "short": 1, "long": BLOCK}


def test_no_profile_learns_online_then_applies(make_vllm_config):
    scheduler = build(QuotaScheduler, make_vllm_config({"min_fit_steps": 4, "refit_every_steps": 1,
                                                        "ignore_first_steps": 2}))
    scheduler.add_request(request("a", 100))
    steps = [step(scheduler) for _ in range(5)]  # 2 ignored, 3 measured
    assert not scheduler.step_model.fitted and steps[0] == {"a": 100}
    step(scheduler)
    assert scheduler.step_model.fitted


def test_profile_written_at_shutdown_and_bad_profile_refused(make_vllm_config, tmp_path):
    path = tmp_path / "learned.json"
    scheduler = build(QuotaScheduler, make_vllm_config({"min_fit_steps": 4, "refit_every_steps": 1,
                                                        "ignore_first_steps": 0, "profile": str(path)}))
    scheduler.add_request(request("a", 100))
    for _ in range(5):
        step(scheduler)
    scheduler.shutdown()
    assert StepTimeModel.load(path).fitted
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="additional_config.compute_quota.'profile'"):
        build(QuotaScheduler, make_vllm_config({"profile": str(path)}))


def test_scheduler_class_must_match_async_scheduling(make_vllm_config):
    with pytest.raises(ConfigError, match="AsyncQuotaScheduler"):
        build(QuotaScheduler, make_vllm_config({}, async_scheduling=True))
    with pytest.raises(ConfigError, match="use dualpath_connector.QuotaScheduler"):
        build(AsyncQuotaScheduler, make_vllm_config({}))


def test_a_waiting_prompt_cut_to_nothing_keeps_those_behind_it_waiting(make_vllm_config, profile):
    """FIFO under vLLM 0.33 too, which skips a waiting request answered 0 and asks about the next one (0.32
    stops). A long prompt with a cached prefix (each new token attends to it) gets nothing of a nearly full
    step, while a short prompt behind it would fit: it must wait as well."""
    # COEFFICIENTS: the 250-token prefill already in the step is predicted 35.3125 ms; 0.15 ms are left, which
    # holds one token without context (0.1 ms) but none after 7,000 cached ones (0.17 ms).
    scheduler = build(QuotaScheduler, make_vllm_config({"quota_ms": 35.4625, "profile": profile,
                                                        "learn_online": False}))
    long_, short = request("long", 8000), request("short", 60)

    def in_a_step(*asked: tuple[Request, int, int]) -> list[int]:
        scheduler._step = StepShape()
        scheduler._step.add(0, 250, decode=False)  # a prefill already in this step: no floor for the next
        scheduler._prefill_in_step, scheduler._admission_closed = True, False
        return [scheduler._reserve_prefill_lookahead(r, computed, new) for r, computed, new in asked]

    (alone,) = in_a_step((short, 0, 60))
    assert alone > 0  # the control: without the long prompt before it, the short one is admitted
    assert in_a_step((long_, 7000, 1000), (short, 0, 60)) == [0, 0]
