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


def select_prefill_by_node(
    accounting: Accounting, read_queues: Mapping[str, int], alpha_tokens: float, beta_tokens: float
) -> EngineLoad | None:
    """:func:`select_prefill_dualpath` over every PE, from each node's least-loaded PE: O(PE nodes).

    The least (tokens, position) PE on short-read-queue nodes is Algorithm 1's
    choice if it is within beta; if it is not, no PE there is, and the choice
    is the least PE of all, if within beta.
    """
    books = accounting.books
    short: tuple[tuple[int, int], EngineLoad] | None = None
    least: tuple[tuple[int, int], EngineLoad] | None = None
    for node in books.nodes_by_role["prefill"]:
        engine = books.least_tokens("prefill", node)
        rank = (engine.unfinished_tokens, books.position[engine.name])
        if least is None or rank < least[0]:
            least = (rank, engine)
        if (short is None or rank < short[0]) and read_queues.get(node, 0) <= alpha_tokens:
            short = (rank, engine)
    if short is not None and short[1].unfinished_tokens <= beta_tokens:
        return short[1]
    return least[1] if least is not None and least[1].unfinished_tokens <= beta_tokens else None


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
    return _select_in_group(group, sum(e.unfinished_tokens for e in group), request_tokens, threshold_factor)


def select_decode_by_node(accounting: Accounting, request_tokens: int, threshold_factor: float) -> EngineLoad:
    """:func:`select_decode_dualpath` over every DE, from the per-node token totals: O(DE nodes + group)."""
    tokens = accounting.books.tokens
    node = min(accounting.books.nodes_by_role["decode"], key=lambda n: tokens[("decode", n)])
    group = accounting.books.members[("decode", node)]
    return _select_in_group(group, tokens[("decode", node)], request_tokens, threshold_factor)


def _select_in_group(group: Sequence[EngineLoad], group_tokens: int, request_tokens: int,
                     threshold_factor: float) -> EngineLoad:  # fmt: skip
    """Phase 2 of :func:`select_decode_dualpath` within the chosen group."""
    fits = [e for e in group if e.free_kv_tokens is None or e.free_kv_tokens >= request_tokens]
    if not fits:
        # The paper stops fetching here; a vLLM engine queues the request
        # itself, so send it where the most memory frees up first.
        return max(group, key=lambda e: e.free_kv_tokens or 0.0)
    threshold = threshold_factor * (request_tokens + group_tokens) / len(group)
    below = [e for e in fits if e.unfinished_tokens + request_tokens <= threshold]
    if below:
        return min(below, key=lambda e: e.unfinished_requests)
    return min(fits, key=lambda e: e.unfinished_tokens)


def select_read_side(pe: EngineLoad, de: EngineLoad, read_queues: Mapping[str, int]) -> ReadSide:
    """The side whose node has the shorter read queue; the PE on a tie (no extra hop)."""
    return "de" if read_queues.get(de.node, 0) < read_queues.get(pe.node, 0) else "pe"


class Policy(ABC):
    name: PolicyName
    # Whether DEs read hits at all (for the PE, or a read the PE moves to its DE while its own link is busy).
    decode_side_reads: bool = True

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
    decode_side_reads = False

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

    # Candidate lists that are the whole role (``Accounting.role``'s own
    # list, as the dispatcher passes while every engine is healthy) are
    # chosen from the per-node totals; subsets by the plain formulas.
    def choose_prefill(self, pes, accounting, tokens):
        alpha = accounting.alpha_tokens(self.scheduling.alpha_s)
        beta = accounting.beta_tokens(self.scheduling.beta_s)
        if pes is accounting.role("prefill"):
            return select_prefill_by_node(accounting, accounting.read_queues(), alpha, beta)
        return select_prefill_dualpath(pes, accounting.read_queues(), alpha, beta)

    def choose_decode(self, des, accounting, tokens):
        factor = self.scheduling.de_token_threshold_factor
        if des is accounting.role("decode"):
            return select_decode_by_node(accounting, tokens, factor)
        return select_decode_dualpath(des, tokens, factor)

    def choose_read_side(self, pe, de, accounting):
        return select_read_side(pe, de, accounting.read_queues())


def make_policy(name: PolicyName, scheduling: SchedulingConfig) -> Policy:
    if name == "basic":
        return BasicPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    return DualPathPolicy(scheduling)
