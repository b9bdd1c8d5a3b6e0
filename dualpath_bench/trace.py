"""Agent trajectories: a seeded generator shaped like the DualPath paper's traces, and JSONL I/O.

A trajectory is a list of turns; turn ``i`` appends ``append`` (token ids: tool
output, user input) to the context and generates exactly ``output_tokens``
tokens (paper appendix A.3). The replayed prompt of turn ``i`` is therefore
``A_1 G_1 ... A_{i-1} G_{i-1} A_i`` and the context grows every turn.

Shape of the defaults. Our copy of the paper does not carry Table 2's numbers;
§3 gives the coding trace's means: 157 turns, 32.7k context, 429 appended tokens
per turn, at a 64k maximum context. The generator keeps the per-turn token
counts in proportion to the maximum context (``max_context / 65536``: 8192 ->
1/8, so about 54 appended tokens) and, like the paper's replay (§7.3), cuts a
trajectory where the next turn would pass ``max_context``. Generated tokens per
turn are not in our copy either; 200 at 64k (25 at 8k) is an assumption,
in line with "each individual tool call ... is short". A first turn carries the
task and system prompt (``first_append_tokens``), the synthetic first round the
paper prepends to make more trajectories.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dualpath_bench.errors import BenchUsageError

logger = logging.getLogger(__name__)

VOCAB = 1024  # the tiny test Llama's vocabulary (dualpath_dev.tiny_model.TINY_LLAMA)
PAPER_MAX_CONTEXT = 65536
PAPER_APPEND_TOKENS = 429
PAPER_GEN_TOKENS = 200  # assumed, see the module docstring
PAPER_TURNS = 157


class TraceError(BenchUsageError, ValueError):
    """A trace file or generator setting that cannot be used; the message names the bad field."""


@dataclass(frozen=True)
class TraceConfig:
    """Generator settings. Token counts are means of lognormal draws (``sigma``), at least 1."""

    agents: int = 8
    seed: int = 0
    max_context: int = 8192
    turns: int = PAPER_TURNS
    append_tokens: int = round(PAPER_APPEND_TOKENS * 8192 / PAPER_MAX_CONTEXT)
    output_tokens: int = round(PAPER_GEN_TOKENS * 8192 / PAPER_MAX_CONTEXT)
    first_append_tokens: int = 1024
    sigma: float = 0.5
    vocab: int = VOCAB

    def validate(self) -> TraceConfig:
        for name in ("agents", "max_context", "turns", "append_tokens", "output_tokens", "first_append_tokens", "vocab"):
            if getattr(self, name) < 1:
                raise TraceError(f"trace.{name} must be >= 1, got {getattr(self, name)}")
        if self.sigma < 0:
            raise TraceError(f"trace.sigma must be >= 0, got {self.sigma}")
        if self.first_append_tokens + self.output_tokens > self.max_context:
            raise TraceError(
                f"trace.first_append_tokens + trace.output_tokens ({self.first_append_tokens} + {self.output_tokens}) "
                f"must fit trace.max_context ({self.max_context})"
            )
        return self

    @classmethod
    def from_dict(cls, values: dict) -> TraceConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise TraceError(f"unknown trace setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values).validate()


@dataclass
class Turn:
    append: list[int]
    output_tokens: int


@dataclass
class Agent:
    agent_id: str
    turns: list[Turn] = field(default_factory=list)

    def total_tokens(self) -> int:
        return sum(len(t.append) + t.output_tokens for t in self.turns)


def _draw(rng: random.Random, mean: int, sigma: float) -> int:
    # Lognormal with the given mean: mu = ln(mean) - sigma^2 / 2.
    if sigma == 0:
        return mean
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def _agent_turns(config: TraceConfig, index: int, with_ids: bool) -> list[tuple[int, int, list[int] | None]]:
    """Agent ``index``'s turns as (append tokens, output tokens, append ids or ``None``)."""
    # One stream per agent, so agent k is the same whatever config.agents is.
    rng = random.Random(f"dualpath-bench/{config.seed}/{index}")
    turns_wanted = max(1, _draw(rng, config.turns, config.sigma))
    turns = []
    context = 0
    for turn in range(turns_wanted):
        append = config.first_append_tokens if turn == 0 else _draw(rng, config.append_tokens, config.sigma)
        output = _draw(rng, config.output_tokens, config.sigma)
        if context + append + output > config.max_context:
            break  # the paper's replay cuts a trajectory at its maximum length
        turns.append((append, output, rng.choices(range(config.vocab), k=append) if with_ids else None))
        context += append + output
    return turns


def generate(config: TraceConfig) -> list[Agent]:
    """Trajectories for ``config``; the same config (seed included) always gives the same trace."""
    config.validate()
    return [Agent(f"agent-{index:04d}", [Turn(ids, output) for _, output, ids in _agent_turns(config, index, True)])
            for index in range(config.agents)]  # fmt: skip


def turn_lengths(config: TraceConfig) -> list[list[tuple[int, int]]]:
    """Each agent's (append, output) token counts per turn, without token ids: the simulator's trace.

    Same distributions as :func:`generate`, at a fraction of the cost (a paper-scale trace has ~10^8
    token ids). The id draws are skipped, so the counts are not :func:`generate`'s for the same seed.
    """
    config.validate()
    return [[(append, output) for append, output, _ in _agent_turns(config, index, False)]
            for index in range(config.agents)]  # fmt: skip


def summarize(agents: Iterable[Agent]) -> dict[str, float]:
    """Table 2's columns for a trace: mean turns, append, gen, total and context tokens per turn."""
    agents = list(agents)
    turns = [t for a in agents for t in a.turns]
    contexts = []
    for agent in agents:
        context = 0
        for turn in agent.turns:
            contexts.append(context)
            context += len(turn.append) + turn.output_tokens
    n = max(1, len(turns))
    return {
        "agents": len(agents),
        "turns": len(turns) / max(1, len(agents)),
        "append": sum(len(t.append) for t in turns) / n,
        "gen": sum(t.output_tokens for t in turns) / n,
        "total": sum(a.total_tokens() for a in agents) / max(1, len(agents)),
        "context": sum(contexts) / n,
        "hit_ratio": sum(contexts) / max(1, sum(contexts) + sum(len(t.append) for t in turns)),
    }


def write_jsonl(agents: Iterable[Agent], path: str | Path) -> Path:
    """One agent per line: ``{"agent_id", "turns": [{"append": [ids], "output_tokens"}]}``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as out:
        for agent in agents:
            out.write(json.dumps(asdict(agent), separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path, vocab: int = VOCAB) -> list[Agent]:
    """Agents of a JSONL trace, checked line by line (errors name the line and the field)."""
    agents = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc})") from None
            agents.append(_agent_from_json(raw, where, vocab))
    if not agents:
        raise TraceError(f"{path}: no agents")
    return agents


def _agent_from_json(raw: object, where: str, vocab: int) -> Agent:
    if not isinstance(raw, dict) or not isinstance(raw.get("agent_id"), str):
        raise TraceError(f"{where}: agent_id must be a string")
    if not isinstance(raw.get("turns"), list) or not raw["turns"]:
        raise TraceError(f"{where}: turns must be a non-empty list")
    agent = Agent(raw["agent_id"])
    for i, turn in enumerate(raw["turns"]):
        append = turn.get("append") if isinstance(turn, dict) else None
        output = turn.get("output_tokens") if isinstance(turn, dict) else None
        if not isinstance(append, list) or not append:
            raise TraceError(f"{where}: turns[{i}].append must be a non-empty list of token ids")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in append):
            raise TraceError(f"{where}: turns[{i}].append holds a token id outside [0, {vocab})")
        if not isinstance(output, int) or output < 1:
            raise TraceError(f"{where}: turns[{i}].output_tokens must be an integer >= 1, got {output!r}")
        agent.turns.append(Turn(append, output))
    return agent
