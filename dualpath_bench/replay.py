"""Replays agent trajectories through a running ``dualpath-router`` and measures them.

Each agent runs its turns in order: the prompt of turn ``i`` is the previous
prompt, the previous output and the turn's append (token ids; the router
passes them to the engines untouched), streamed with exactly
``output_tokens`` generated (``ignore_eos``, greedy). The stream gives the time
to the first and the second token and the time per output token.

Before the next turn an agent waits until the decode engine has stored the
chunks of its last prompt and output (saves are asynchronous, the next turn's
hit depends on them), as ``disagg_demo`` does: a tool call would take at
least that long. The wait asks a lookup-only store for the chunks not seen
stored before, through a :class:`StoreWatcher`; its time is reported
(``store_wait_s``) and counts in the JCT. Without a watcher the next turn may
find a shorter hit than the trace intends.

Modes (DualPath paper §7.3, §7.4): **offline**, all agents start together and
the job completion time (JCT) is when the last one is done; **online**, agents
arrive as a Poisson process at ``rate`` agents per second, and the TTFT/TPOT
percentiles are checked against an SLO.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from nixl_backends.lookup import PresentChunks, wait_stored
from nixl_backends.store import KVStore

from dualpath_connector.protocol import StoreKeySpace, sse_lines

from dualpath_bench.errors import BenchUsageError
from dualpath_bench.trace import Agent

logger = logging.getLogger(__name__)

MODES = ("offline", "online")

# Idle connections to the router are dropped this soon, before its server closes them (dualpath-router and
# uvicorn's default: 5 s; httpx's default expiry is also 5 s): a turn sent on a connection the server is closing
# fails with ReadError and nothing here resends it (a dualpath-bench run lost a turn so, the router logging nothing
# for it: the race inferred, not caught).
KEEPALIVE_EXPIRY_S = 2.0


class ReplayError(BenchUsageError, ValueError):
    """A replay setting that cannot work; the message names the setting."""


@dataclass(frozen=True)
class ReplayConfig:
    router_url: str
    model: str
    mode: str = "offline"
    rate: float = 0.0  # online: agents per second
    seed: int = 0  # online: arrival times
    token_salt: int = 0  # added to every token id (mod vocab): a fresh prefix space per run on a shared store
    vocab: int = 1024
    max_context: int = 8192
    request_timeout_s: float = 900.0
    store_wait_timeout_s: float = 120.0
    slo_ttft_s: float = 4.0
    slo_tpot_s: float = 0.05
    slo_percentile: float = 90.0
    progress: bool = True

    def validate(self) -> ReplayConfig:
        if not self.router_url.startswith(("http://", "https://")):
            raise ReplayError(f"replay.router_url must be http(s)://host:port, got {self.router_url!r}")
        if self.mode not in MODES:
            raise ReplayError(f"replay.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "online" and self.rate <= 0:
            raise ReplayError(f"replay.rate (agents per second) must be > 0 in online mode, got {self.rate}")
        for name in ("request_timeout_s", "store_wait_timeout_s", "slo_ttft_s", "slo_tpot_s"):
            if getattr(self, name) <= 0:
                raise ReplayError(f"replay.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.slo_percentile <= 100:
            raise ReplayError(f"replay.slo_percentile must be in (0, 100], got {self.slo_percentile}")
        return self


@dataclass
class TurnRecord:
    agent: str
    turn: int
    prompt_tokens: int
    output_tokens: int = 0
    hit_tokens: int = 0
    read_side: str = ""
    prefill_engine: str = ""
    decode_engine: str = ""
    start_s: float = 0.0  # since the replay started
    ttft_s: float | None = None
    ttst_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    store_wait_s: float = 0.0
    error: str = ""


@dataclass
class ReplayResult:
    config: dict
    records: list[TurnRecord] = field(default_factory=list)
    jct_s: float = 0.0
    agents_done: int = 0
    agents_failed: int = 0

    def summary(self) -> dict:
        return summarize(self)

    def to_json(self) -> dict:
        return {
            "config": self.config,
            "summary": self.summary(),
            "records": [asdict(r) for r in self.records],
        }


class StoreWatcher:
    """Waits until an agent's chunks are stored, asking the store only for chunks not seen stored before."""

    def __init__(self, store: KVStore, key_space: StoreKeySpace, remembered_chunks: int = 100_000) -> None:
        self._store = store
        self.key_space = key_space
        # Each agent's context only grows: its earlier chunks were seen at its last turn.
        self._seen = PresentChunks(remembered_chunks)

    def wait(self, tokens: list[int], timeout_s: float) -> None:
        """Blocking; run it off the event loop."""
        keys = self.key_space.chunk_keys(tokens)
        new = keys[self._seen.known_run(keys) :]
        wait_stored(self._store, new, timeout_s)
        self._seen.remember(new)

    def close(self) -> None:
        self._store.close()


def arrivals(n: int, config: ReplayConfig) -> list[float]:
    """Start offsets of ``n`` agents: all 0 offline, Poisson (seeded) online."""
    if config.mode == "offline":
        return [0.0] * n
    rng = random.Random(f"dualpath-bench/arrivals/{config.seed}")
    times, now = [], 0.0
    for _ in range(n):
        now += rng.expovariate(config.rate)
        times.append(now)
    return times


def replay(agents: list[Agent], config: ReplayConfig, watcher: StoreWatcher | None = None) -> ReplayResult:
    """Run the trace against the router; every turn is recorded, failures included."""
    config.validate()
    too_long = [a.agent_id for a in agents if a.total_tokens() > config.max_context]
    if too_long:
        raise ReplayError(f"agents {too_long[:5]} exceed replay.max_context ({config.max_context}) tokens")
    if watcher is None:
        logger.warning("no store watcher: a turn may start before the previous one's chunks are stored")
    return asyncio.run(_replay(agents, config, watcher))


async def _replay(agents: list[Agent], config: ReplayConfig, watcher: StoreWatcher | None) -> ReplayResult:
    import httpx
    from tqdm import tqdm

    result = ReplayResult(config=asdict(config))
    bar = tqdm(total=sum(len(a.turns) for a in agents), unit="turn", desc=config.mode, disable=not config.progress)
    limits = httpx.Limits(max_connections=len(agents) + 4, max_keepalive_connections=len(agents) + 4,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=config.router_url, limits=limits, timeout=timeout) as client:
        runs = [
            _agent(client, agent, offset, config, watcher, result, bar, started)
            for agent, offset in zip(agents, arrivals(len(agents), config))
        ]
        outcomes = await asyncio.gather(*runs, return_exceptions=True)
    bar.close()
    result.jct_s = time.perf_counter() - started
    for agent, outcome in zip(agents, outcomes):
        if isinstance(outcome, BaseException):
            logger.error("agent %s failed: %s", agent.agent_id, outcome)
            result.agents_failed += 1
        else:
            result.agents_done += 1
    return result


async def _agent(client, agent: Agent, offset: float, config: ReplayConfig, watcher: StoreWatcher | None,
                 result: ReplayResult, bar, started: float) -> None:  # fmt: skip
    delay = offset - (time.perf_counter() - started)
    if delay > 0:
        await asyncio.sleep(delay)  # the arrival schedule itself, not a wait for another task
    salt = config.token_salt % config.vocab
    context: list[int] = []
    for index, turn in enumerate(agent.turns):
        prompt = context + [(t + salt) % config.vocab for t in turn.append]
        record = TurnRecord(agent.agent_id, index, len(prompt), start_s=time.perf_counter() - started)
        result.records.append(record)
        try:
            output = await _complete(client, prompt, turn.output_tokens, config, record)
        except Exception as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            bar.update(len(agent.turns) - index)
            raise
        context = prompt + output
        if watcher is not None and index + 1 < len(agent.turns):
            clock = time.perf_counter()
            # The last output token's KV is never computed, so it is never stored.
            await asyncio.to_thread(watcher.wait, context[:-1], config.store_wait_timeout_s)
            record.store_wait_s = time.perf_counter() - clock
        bar.update(1)


async def _complete(client, prompt: list[int], max_tokens: int, config: ReplayConfig, record: TurnRecord) -> list[int]:
    body = {
        "model": config.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip
    tokens: list[int] = []
    times: list[float] = []
    clock = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        headers = response.headers
        record.read_side = headers.get("x-dualpath-read-side", "")
        record.hit_tokens = int(headers.get("x-dualpath-hit-tokens", 0))
        record.prefill_engine = headers.get("x-dualpath-prefill-engine", "")
        record.decode_engine = headers.get("x-dualpath-decode-engine", "")
        # Not aiter_lines: it also splits at U+2028 and U+0085, which a generated text may hold raw.
        async for line in sse_lines(response.aiter_bytes()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            now = time.perf_counter() - clock
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or []
                tokens.extend(ids)
                times.extend([now] * len(ids))
    record.e2e_s = time.perf_counter() - clock
    record.output_tokens = len(tokens)
    if not tokens:
        raise RuntimeError("the stream carried no token ids (does the router pass return_token_ids?)")
    if len(tokens) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {len(tokens)}")
    record.ttft_s = times[0]
    if len(times) > 1:
        record.ttst_s = times[1]
        record.tpot_s = (times[-1] - times[0]) / (len(times) - 1)
    return tokens


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    array = np.asarray(values)
    return {
        "mean": float(array.mean()),
        "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)),
        "p99": float(np.percentile(array, 99)),
        "max": float(array.max()),
    }


def summarize(result: ReplayResult) -> dict:
    ok = [r for r in result.records if not r.error]
    config = result.config
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    summary = {
        "mode": config["mode"],
        "jct_s": result.jct_s,
        "agents_done": result.agents_done,
        "agents_failed": result.agents_failed,
        "requests": len(result.records),
        "failed_requests": len(result.records) - len(ok),
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "hit_tokens": sum(r.hit_tokens for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "read_sides": {side: sum(1 for r in ok if r.read_side == side) for side in sorted({r.read_side for r in ok})},
        "store_wait_s": sum(r.store_wait_s for r in ok),
        "ttft_s": _percentiles(ttft),
        "ttst_s": _percentiles([r.ttst_s for r in ok if r.ttst_s is not None]),
        "tpot_s": _percentiles(tpot),
        "e2e_s": _percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
    }
    if config["mode"] == "online":
        q = config["slo_percentile"]
        ttft_q = float(np.percentile(ttft, q)) if ttft else float("inf")
        tpot_q = float(np.percentile(tpot, q)) if tpot else float("inf")
        summary["slo"] = {
            "percentile": q,
            "ttft_s": ttft_q,
            "tpot_s": tpot_q,
            "ttft_limit_s": config["slo_ttft_s"],
            "tpot_limit_s": config["slo_tpot_s"],
            "holds": not (len(result.records) - len(ok))
            and ttft_q <= config["slo_ttft_s"]
            and tpot_q <= config["slo_tpot_s"],
        }
    return summary
