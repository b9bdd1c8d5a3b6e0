"""Where a request goes: which PE, which DE, which side reads the hit (paper §6.1).

Policies are pure choices over the current :class:`Accounting`; the
dispatcher applies them, keeps the books and queues requests no PE can take.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Literal

from dualpath_router.accounting import Accounting, EngineLoad
from dualpath_router.config import PolicyName, SchedulingConfig

ReadSide = Literal["pe", "de"]


def select_prefill_dualpath(
    pes: Sequence[EngineLoad], read_queues: Mapping[str, int], alpha_tokens: float, beta_tokens: float
) -> EngineLoad | None:
    """Algorithm 1: skip PEs over beta; prefer nodes whose read queue is within alpha; least tokens.

    ``None`` means every PE is overloaded: the request waits in the router.
    """
    not_overloaded = [e for e in pes if e.unfinished_tokens <= beta_tokens]
    short_read_queue = [e for e in not_overloaded if read_queues.get(e.node, 0) <= alpha_tokens]
    category = short_read_queue or not_overloaded
    return min(category, key=lambda e: e.unfinished_tokens) if category else None


def select_decode_dualpath(des: Sequence[EngineLoad], request_tokens: int, threshold_factor: float) -> EngineLoad:
    """Two-phase DE scheduling for one request.

    Phase 1: the group (node) with the fewest unfinished tokens. Phase 2,
    within it: among DEs with free KV memory for the request, those not above
    the high-token threshold ``Z = factor x (request + group tokens) / |group|``
    by fewest requests, else the high-token ones by fewest tokens.
    """
    groups: dict[str, list[EngineLoad]] = defaultdict(list)
    for engine in des:
        groups[engine.node].append(engine)
    group = min(groups.values(), key=lambda g: sum(e.unfinished_tokens for e in g))
    fits = [e for e in group if e.free_kv_tokens is None or e.free_kv_tokens >= request_tokens]
    if not fits:
        # The paper stops fetching here; a vLLM engine queues the request
        # itself, so send it where the most memory frees up first.
        return max(group, key=lambda e: e.free_kv_tokens or 0.0)
    threshold = threshold_factor * (request_tokens + sum(e.unfinished_tokens for e in group)) / len(group)
    below = [e for e in fits if e.unfinished_tokens + request_tokens <= threshold]
    if below:
        return min(below, key=lambda e: e.unfinished_requests)
    return min(fits, key=lambda e: e.unfinished_tokens)


def select_read_side(pe: EngineLoad, de: EngineLoad, read_queues: Mapping[str, int]) -> ReadSide:
    """The side whose node has the shorter read queue; the PE on a tie (no extra hop)."""
    return "de" if read_queues.get(de.node, 0) < read_queues.get(pe.node, 0) else "pe"


class Policy(ABC):
    name: PolicyName

    @abstractmethod
    def choose_prefill(self, pes: Sequence[EngineLoad], accounting: Accounting, tokens: int) -> EngineLoad | None:
        """A PE for a request of ``tokens`` prompt tokens, or ``None`` to queue it."""

    @abstractmethod
    def choose_decode(self, des: Sequence[EngineLoad], accounting: Accounting, tokens: int) -> EngineLoad:
        """A DE for a request of ``tokens`` prompt tokens."""

    @abstractmethod
    def choose_read_side(self, pe: EngineLoad, de: EngineLoad, accounting: Accounting) -> ReadSide:
        """Which side reads the hit from the store."""


def _least_tokens(engines: Sequence[EngineLoad]) -> EngineLoad:
    return min(engines, key=lambda e: e.unfinished_tokens)


class BasicPolicy(Policy):
    """Conventional PD: the PE reads every hit; least unfinished tokens on both roles."""

    name = "basic"

    def choose_prefill(self, pes, accounting, tokens):
        return _least_tokens(pes)

    def choose_decode(self, des, accounting, tokens):
        return _least_tokens(des)

    def choose_read_side(self, pe, de, accounting):
        return "pe"


class RoundRobinPolicy(Policy):
    """Engines in turn, read sides in turn: the load-blind baseline of the paper's ablation."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turns = {"prefill": itertools.count(), "decode": itertools.count(), "read": itertools.count()}

    def _next(self, turn: str, engines: Sequence[EngineLoad]) -> EngineLoad:
        return engines[next(self._turns[turn]) % len(engines)]

    def choose_prefill(self, pes, accounting, tokens):
        return self._next("prefill", pes)

    def choose_decode(self, des, accounting, tokens):
        return self._next("decode", des)

    def choose_read_side(self, pe, de, accounting):
        return ("pe", "de")[next(self._turns["read"]) % 2]


class DualPathPolicy(Policy):
    """Algorithm 1 for PEs, two-phase DE scheduling, shorter read queue reads."""

    name = "dualpath"

    def __init__(self, scheduling: SchedulingConfig) -> None:
        self.scheduling = scheduling

    def choose_prefill(self, pes, accounting, tokens):
        return select_prefill_dualpath(
            pes,
            accounting.read_queues(),
            accounting.alpha_tokens(self.scheduling.alpha_s),
            accounting.beta_tokens(self.scheduling.beta_s),
        )

    def choose_decode(self, des, accounting, tokens):
        return select_decode_dualpath(des, tokens, self.scheduling.de_token_threshold_factor)

    def choose_read_side(self, pe, de, accounting):
        return select_read_side(pe, de, accounting.read_queues())


def make_policy(name: PolicyName, scheduling: SchedulingConfig) -> Policy:
    if name == "basic":
        return BasicPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    return DualPathPolicy(scheduling)
