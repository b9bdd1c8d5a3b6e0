"""The compute quota: a vLLM scheduler that sizes each step's chunked prefill to a time quota.

DualPath §6.2 / A.4: requests join a step in FIFO order while the step's predicted time stays
under the quota; the first prefill that does not fit is chunked to the largest size that does
(binary search over its tokens), and the requests after it wait for the next step. A step's
length then stays near the quota whatever mix of long and short prompts arrives, so decodes
batched with a long prefill are not stalled behind all of it.

Enable with ``--scheduler-cls dualpath_connector.QuotaScheduler`` (engines with
async scheduling, vLLM's default on GPU: ``AsyncQuotaScheduler``). Settings come from
``--additional-config '{"compute_quota": {...}}'`` (:class:`ComputeQuotaConfig`).

How it plugs into vLLM's own scheduling loop (nothing of ``schedule()`` is copied): vLLM asks
``_reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)`` for the final
token count of every request it schedules, running and waiting, after its own budget and
caps, with the request's real context (local and connector hits included). This class
answers it: decodes unchanged (their cost is reserved when the step starts, so they always
run), prefills cut to what fits. A waiting request cut to 0 ends admission for the step (FIFO,
as the paper): vLLM 0.32 stops there itself, 0.33 skips it and asks about those behind it, so
every later waiting request of the step is answered 0 here; a running one is skipped for this step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from dualpath_connector.scheduler.step_time_model import StepRecorder, StepShape, StepTimeModel
from nixl_backends.configuration import ConfigError, from_dict

logger = logging.getLogger(__name__)

CONFIG_SECTION = "compute_quota"
_WHERE = f"additional_config.{CONFIG_SECTION}."
# vLLM's per-request hook this plugin answers; checked at start-up so a vLLM without it fails loudly.
_HOOK = "_reserve_prefill_lookahead"


@dataclass
class ComputeQuotaConfig:
    """``additional_config.compute_quota``: all keys optional."""

    # Predicted step time the prefills of one step may fill (the paper: 300 ms).
    quota_ms: float = 300.0
    # The smallest chunk the step's first prefill gets even when nothing fits (default: one
    # KV block), so a prefill always progresses.
    floor_tokens: int | None = None
    # A step-time profile (JSON, StepTimeModel.save) loaded at start-up and written back at
    # shutdown with the model refined online; None: learn from this engine's steps only.
    profile: str | None = None
    # Measured steps before the first fit (with no profile the quota is not applied until then),
    # how many recent steps a fit uses, and how often it refits.
    min_fit_steps: int = 32
    fit_window_steps: int = 2048
    refit_every_steps: int = 16
    # The engine's first steps are not measured: they include one-time warm-up (on CPU the first
    # step took 3.3 s for a 50 ms prefill), which would skew a least-squares fit for a long time.
    ignore_first_steps: int = 4
    # Refit from measured steps while serving (off: the profile's coefficients stay as loaded).
    learn_online: bool = True

    def validate(self) -> None:
        if not self.quota_ms > 0:
            raise ConfigError(f"bad value for {_WHERE}'quota_ms': {self.quota_ms!r} must be > 0")
        if self.floor_tokens is not None and self.floor_tokens < 1:
            raise ConfigError(f"bad value for {_WHERE}'floor_tokens': {self.floor_tokens!r} must be >= 1")
        if self.min_fit_steps < 4:
            raise ConfigError(f"bad value for {_WHERE}'min_fit_steps': {self.min_fit_steps!r} must be >= 4")
        if self.fit_window_steps < self.min_fit_steps:
            raise ConfigError(
                f"bad value for {_WHERE}'fit_window_steps': {self.fit_window_steps!r} must be >= "
                f"min_fit_steps ({self.min_fit_steps})"
            )
        if self.refit_every_steps < 1:
            raise ConfigError(
                f"bad value for {_WHERE}'refit_every_steps': {self.refit_every_steps!r} must be >= 1"
            )
        if self.ignore_first_steps < 0:
            raise ConfigError(
                f"bad value for {_WHERE}'ignore_first_steps': {self.ignore_first_steps!r} must be >= 0"
            )
        if self.profile is None and not self.learn_online:
            raise ConfigError(f"{_WHERE}'learn_online': false needs {_WHERE}'profile' (else nothing fits a model)")


def parse_quota_config(additional_config: Any) -> ComputeQuotaConfig:
    """The ``compute_quota`` section of vLLM's ``additional_config`` (absent: the defaults)."""
    section = additional_config.get(CONFIG_SECTION) if isinstance(additional_config, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"additional_config.{CONFIG_SECTION} must be an object, got {type(section).__name__}")
    return from_dict(ComputeQuotaConfig, section, _WHERE)


def largest_fitting(fits: Callable[[int], bool], most: int) -> int:
    """The largest ``n`` in ``[0, most]`` with ``fits(n)``, for ``fits`` true up to a point then false."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def quota_chunk(model: StepTimeModel, step: StepShape, quota_s: float, context: int,
                wanted: int, floor: int | None) -> int:
    """Tokens a prefill of ``wanted`` new tokens after ``context`` gets in ``step`` under the quota.

    ``floor``: the minimum it gets anyway (the step's first prefill), None: 0 when nothing fits.
    """
    def fits(n: int) -> bool:
        return model.predict(step.with_prefill(context, n)) <= quota_s

    if fits(wanted):
        return wanted
    chunk = largest_fitting(fits, wanted)
    if floor is not None:
        chunk = max(chunk, min(floor, wanted))
    return chunk


@dataclass
class _PendingStep:
    shape: StepShape
    scheduled_at: float


class _ComputeQuotaMixin:
    """The quota over any vLLM v1 ``Scheduler`` (see the module docstring)."""

    _async_base: bool = False

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        self.quota_config = parse_quota_config(vllm_config.additional_config)
        async_engine = bool(vllm_config.scheduler_config.async_scheduling)
        if async_engine != self._async_base:
            wanted = "AsyncQuotaScheduler" if async_engine else "QuotaScheduler"
            raise ConfigError(
                f"--scheduler-cls {type(self).__name__} on an engine with async scheduling "
                f"{'on' if async_engine else 'off'}: use dualpath_connector.{wanted}"
            )
        if not callable(getattr(Scheduler, _HOOK, None)):
            raise RuntimeError(f"this vLLM's Scheduler has no {_HOOK}(); the compute quota cannot plug in")
        super().__init__(vllm_config, *args, **kwargs)
        config = self.quota_config
        self.quota_s = config.quota_ms / 1000.0
        self.floor_tokens = config.floor_tokens or self.cache_config.block_size
        self.step_model = StepTimeModel()
        if config.profile is not None and Path(config.profile).exists():
            try:
                self.step_model = StepTimeModel.load(Path(config.profile))
            except ValueError as exc:
                raise ConfigError(f"bad profile in {_WHERE}'profile' ({config.profile}): {exc}") from None
        self.step_recorder = StepRecorder(self.step_model, config.fit_window_steps,
                                          config.min_fit_steps, config.refit_every_steps)
        # This step's reserved and granted work; None outside schedule() or while not fitted.
        self._step: StepShape | None = None
        self._prefill_in_step = False
        self._admission_closed = False
        self._pending: dict[int, _PendingStep] = {}
        self._last_output_at = 0.0
        self._steps_to_ignore = config.ignore_first_steps
        # Counters for logs and tests: steps whose prefill the quota cut, and the chunks cut.
        self.quota_limited_steps = 0
        self.quota_limited_chunks = 0
        self._limited_this_step = False
        logger.info(
            "compute quota %.0f ms, floor %d tokens, step-time model %s",
            config.quota_ms, self.floor_tokens,
            f"from {config.profile}" if self.step_model.fitted else
            f"learned online after {config.min_fit_steps} steps",
        )

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._step = self._reserved_decodes() if self.step_model.fitted else None
        self._prefill_in_step = False
        self._limited_this_step = False
        self._admission_closed = False
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._step = None
        self.quota_limited_steps += self._limited_this_step
        if output.total_num_scheduled_tokens and self.quota_config.learn_online:
            if len(self._pending) > 8:  # outputs vLLM never reported back (reset, abort)
                self._pending.clear()
            self._pending[id(output)] = _PendingStep(self._scheduled_shape(output), time.perf_counter())
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        now = time.perf_counter()
        pending = self._pending.pop(id(scheduler_output), None)
        if pending is not None and self._steps_to_ignore:
            self._steps_to_ignore -= 1
        elif pending is not None:
            # From when the step was handed over, or when the previous one finished if it ran
            # behind it (async scheduling), to its result: the step's own execution time.
            seconds = now - max(pending.scheduled_at, self._last_output_at)
            if self.step_recorder.record(pending.shape, seconds):
                logger.debug("compute quota: step-time model refitted: %s", self.step_model.coefficients)
        result = super().update_from_output(scheduler_output, model_runner_output)
        self._last_output_at = time.perf_counter()
        return result

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self._step is None or num_new_tokens == 0 or num_computed_tokens >= request.num_prompt_tokens:
            return num_new_tokens  # no model yet, nothing to do, or a decode (reserved already)
        waiting = request.status != RequestStatus.RUNNING
        if waiting and self._admission_closed:
            return 0  # a waiting request before it was cut to nothing: FIFO, whatever vLLM does with a 0
        floor = None if self._prefill_in_step else self.floor_tokens
        chunk = quota_chunk(self.step_model, self._step, self.quota_s, num_computed_tokens, num_new_tokens, floor)
        if chunk < num_new_tokens:
            self._limited_this_step = True
            self.quota_limited_chunks += 1
            logger.debug(
                "compute quota: request %s gets %d of %d tokens after %d cached (predicted %.1f ms)",
                request.request_id, chunk, num_new_tokens, num_computed_tokens,
                1000 * self.step_model.predict(self._step.with_prefill(num_computed_tokens, chunk)),
            )
        if chunk:
            self._step = self._step.with_prefill(num_computed_tokens, chunk)
            self._prefill_in_step = True
        elif waiting:
            self._admission_closed = True
        return chunk

    def shutdown(self) -> None:
        profile = self.quota_config.profile
        if profile is not None and self.step_model.fitted and self.quota_config.learn_online:
            try:
                self.step_model.save(Path(profile))
            except OSError as exc:
                logger.warning("compute quota: cannot write the step-time profile %s: %s", profile, exc)
        super().shutdown()

    def _reserved_decodes(self) -> StepShape:
        """The decodes of the running requests, which every step schedules whatever the quota."""
        step = StepShape()
        for request in self.running:
            if request.num_computed_tokens >= request.num_prompt_tokens:
                step.add(request.num_computed_tokens, 1 + len(request.spec_token_ids), decode=True)
        return step

    def _scheduled_shape(self, output: Any) -> StepShape:
        shape = StepShape()
        for req_id, new_tokens in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            # schedule() has already advanced num_computed_tokens past this step's tokens.
            context = request.num_computed_tokens - new_tokens
            shape.add(context, new_tokens, decode=context >= request.num_prompt_tokens)
        return shape


class QuotaScheduler(_ComputeQuotaMixin, Scheduler):
    """vLLM's Scheduler with the compute quota (engines without async scheduling, e.g. CPU)."""


class AsyncQuotaScheduler(_ComputeQuotaMixin, AsyncScheduler):
    """vLLM's AsyncScheduler with the compute quota (engines with async scheduling)."""

    _async_base = True
