"""Drives tests/engine_runner.py: one vLLM engine in its own process, stopped by the PID we hold."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dualpath_dev.processes import forward_threads_env, stop_process_group
from dualpath_dev.s3_server import S3Server

RUNNER = Path(__file__).with_name("engine_runner.py")
ENGINE_START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300


def one_process_engine_env() -> dict[str, str]:
    """vLLM's engine core and its one CPU worker in the runner's own process, computing with the thread count
    of the engines that ``vllm serve`` starts (dualpath_dev.engines), so outputs stay equal bit for bit.

    A one-rank engine otherwise spends its start in three interpreters importing vLLM one after the other
    (~40 s here, ~14 s in one); the connector's two halves then share a process, as they do under
    ``vllm serve`` at TP=1 on a GPU.
    """
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **forward_threads_env(1, pinned=False)}


class EngineFailed(RuntimeError):
    pass


class Engine:
    def __init__(
        self, model: Path, kv_transfer_config: dict[str, Any] | None = None, s3: S3Server | None = None,
        one_process: bool = True, **options: Any,
    ) -> None:
        """``one_process``: a one-rank engine runs in the runner's process (:func:`one_process_engine_env`)."""
        args = [sys.executable, str(RUNNER), "--model", str(model)]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.log = tempfile.NamedTemporaryFile(prefix="engine-", suffix=".log", delete=False)
        # vLLM's CPU build reserves one more core when any KV connector is set,
        # which changes the OMP thread count and so the bf16 rounding of every
        # GEMM; engines with and without the connector must compute alike.
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1", PYTHONUNBUFFERED="1")
        if s3 is not None:
            env.update(AWS_ACCESS_KEY_ID=s3.access_key, AWS_SECRET_ACCESS_KEY=s3.secret_key)
        ranks = options.get("tensor_parallel_size", 1)
        env.update(one_process_engine_env() if one_process and ranks == 1 else forward_threads_env(ranks, pinned=False))
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            self.ready = self._read(ENGINE_START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def _read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineFailed(f"engine gave no answer in {timeout_s}s; log tail:\n{self.log_text()[-20000:]}")
            readable, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if readable:
                line = self.proc.stdout.readline()
                if not line:
                    self.proc.wait()
                    raise EngineFailed(f"engine exited ({self.proc.returncode}); log tail:\n{self.log_text()[-20000:]}")
                return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int, reset_prefix_cache: bool = True,
                 cache_salts: list[str | None] | None = None, loras: list[tuple[str, str] | None] | None = None) -> list[dict]:
        """Greedy outputs; ``loras``: an adapter's (name, path) or None per prompt (the engine needs max_loras)."""
        command = {"prompts": prompts, "max_tokens": max_tokens, "reset_prefix_cache": reset_prefix_cache,
                   "cache_salts": cache_salts, "loras": loras}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read(REQUEST_TIMEOUT_S)["outputs"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                pass
        stop_process_group(self.proc, grace_s=10.0)
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_side_by_side(*starts: Callable[[], Engine]) -> list[Engine]:
    """Engines started at once, in the order of ``starts``; all stopped if one fails.

    An engine's start-up is mostly single-threaded imports in three processes
    one after the other, so engines started together overlap on the cores.
    """
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    started = [f.result() for f in futures if f.exception() is None]
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        for engine in started:
            engine.stop()
        raise failures[0]
    return started


def start_engine_expecting_failure(model: Path, kv_transfer_config: dict[str, Any], s3: S3Server | None = None) -> str:
    """Start an engine that must fail during start-up; return its log."""
    try:
        engine = Engine(model, kv_transfer_config, s3)
    except EngineFailed as failure:
        return str(failure)
    engine.stop()
    raise AssertionError("engine started although its configuration is invalid")
