"""The router's O(nodes) placement (Accounting.books, select_*_by_node) chooses exactly as the plain formulas.

A randomized replay of placements, finishes, failed engines and metric
refreshes runs through the real Dispatcher/DualPathPolicy/Accounting, while
the test computes every choice and every book with the per-engine formulas
the router used before the per-node totals (kept here only, as the
reference). A perturbed total must make the replay fail.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from dualpath_router.accounting import Accounting, EngineLoad, EngineReport
from dualpath_router.config import EngineConfig, RouterConfig, SchedulingConfig
from dualpath_router.dispatcher import Dispatcher, Placement
from dualpath_router.lookup import HitLookup
from dualpath_router.policies import DualPathPolicy

# Nodes shared by both roles and engines listed out of node order, so that
# node order, positions and cross-role read queues all matter.
PREFILL = [("pe0", "n0"), ("pe1", "n1"), ("pe2", "n0"), ("pe3", "n2"), ("pe4", "n1"), ("pe5", "n3"), ("pe6", "n2")]
DECODE = [("de0", "n4"), ("de1", "n2"), ("de2", "n4"), ("de3", "n5"), ("de4", "n2"), ("de5", "n5"), ("de6", "n6")]
SCHEDULING = SchedulingConfig(alpha_s=1.0, beta_s=1.0, read_tokens_per_s=3000.0, prefill_tokens_per_s=2000.0,
                              rate_ewma_weight=0.3)  # fmt: skip


# -- the reference: the per-engine formulas, walking every engine --------------------------------------
def ref_read_queues(accounting: Accounting) -> dict[str, int]:
    reported: dict[str, int] = {}
    for e in accounting.engines.values():
        reported[e.node] = reported.get(e.node, 0) + (e.reported_read_queue_tokens if e.reported_requests else 0)
    return {node: max(accounting.dispatched_read_tokens[node], tokens) for node, tokens in reported.items()}


def ref_candidates(accounting: Accounting, role: str, excluded: set[str]) -> list[EngineLoad]:
    engines = [e for e in accounting.engines.values() if e.role == role and e.name not in excluded]
    return [e for e in engines if e.healthy] or engines


def ref_prefill(pes, read_queues, alpha, beta):
    not_overloaded = [e for e in pes if e.unfinished_tokens <= beta]
    short = [e for e in not_overloaded if read_queues.get(e.node, 0) <= alpha]
    category = short or not_overloaded
    return min(category, key=lambda e: e.unfinished_tokens) if category else None


def ref_decode(des, request_tokens, factor):
    groups: dict[str, list[EngineLoad]] = defaultdict(list)
    for engine in des:
        groups[engine.node].append(engine)
    group = min(groups.values(), key=lambda g: sum(e.unfinished_tokens for e in g))
    fits = [e for e in group if e.free_kv_tokens is None or e.free_kv_tokens >= request_tokens]
    if not fits:
        return max(group, key=lambda e: e.free_kv_tokens or 0.0)
    threshold = factor * (request_tokens + sum(e.unfinished_tokens for e in group)) / len(group)
    below = [e for e in fits if e.unfinished_tokens + request_tokens <= threshold]
    if below:
        return min(below, key=lambda e: e.unfinished_requests)
    return min(fits, key=lambda e: e.unfinished_tokens)


def ref_read_side(pe, de, read_queues):
    return "de" if read_queues.get(de.node, 0) < read_queues.get(pe.node, 0) else "pe"


# -- the replay -------------------------------------------------------------------------------------------
class Shadow:
    """The books as the reference keeps them: per engine and per read node, from the reference's choices."""

    def __init__(self, accounting: Accounting) -> None:
        self.tokens = {name: 0 for name in accounting.engines}
        self.requests = {name: 0 for name in accounting.engines}
        self.read = defaultdict(int)

    def check(self, accounting: Accounting) -> None:
        assert {n: e.dispatched_tokens for n, e in accounting.engines.items()} == self.tokens
        assert {n: e.dispatched_requests for n, e in accounting.engines.items()} == self.requests
        assert {n: t for n, t in accounting.dispatched_read_tokens.items() if t} == {n: t for n, t in self.read.items() if t}


def check_node_totals(accounting: Accounting) -> None:
    books = accounting.books
    for (role, node), members in books.members.items():
        assert books.tokens[(role, node)] == sum(e.unfinished_tokens for e in members), (role, node)
        least = min(members, key=lambda e: (e.unfinished_tokens, books.position[e.name]))
        assert books.least_tokens(role, node) is least, (role, node)
    assert dict(accounting.read_queues()) == ref_read_queues(accounting), "read queues differ"
    for role in ("prefill", "decode"):
        assert accounting.all_healthy(role) == all(e.healthy for e in accounting.engines.values() if e.role == role)
        assert accounting.role(role) == [e for e in accounting.engines.values() if e.role == role]


def make_dispatcher() -> Dispatcher:
    config = RouterConfig([EngineConfig(n, f"http://127.0.0.1:1/{n}", node) for n, node in PREFILL],
                          [EngineConfig(n, f"http://127.0.0.1:1/{n}", node, "127.0.0.1:1") for n, node in DECODE],
                          ["m"], vocab_size=1, scheduling=SCHEDULING)  # fmt: skip
    config.validate()
    accounting = Accounting.build(config.prefill_engines, config.decode_engines, SCHEDULING.prefill_tokens_per_s,
                                  SCHEDULING.read_tokens_per_s, SCHEDULING.rate_ewma_weight)  # fmt: skip
    return Dispatcher(config, accounting, DualPathPolicy(SCHEDULING), HitLookup(None, 1))


def random_report(rng: random.Random) -> EngineReport | None:
    if rng.random() < 0.1:
        return None  # a failed scrape: unhealthy until the next good one
    capacity = rng.choice([None, 4000, 20000])
    return EngineReport(
        requests=rng.choice([0, 0, 1, 3]), read_queue_tokens=rng.choice([0, 500, 2000, 8000]),
        kv_usage=None if capacity is None else rng.random(), kv_capacity_tokens=capacity, namespace=None,
        computed_tokens=None, prefill_seconds=None,
    )  # fmt: skip


def replay(seed: int, steps: int, *, check_books: bool = True, perturb=None) -> dict[str, int]:
    """Runs the replay; returns how often each kind of outcome occurred (to show the replay covers them)."""
    rng = random.Random(seed)
    dispatcher = make_dispatcher()
    accounting = dispatcher.accounting
    if perturb is not None:
        perturb(accounting)
    shadow = Shadow(accounting)
    outstanding: list[tuple[Placement, bool]] = []  # (placement, prefill still running)
    seen: dict[str, int] = defaultdict(int)
    for _ in range(steps):
        action = rng.random()
        if action < 0.5:
            prompt = rng.randint(2, 3000)
            hit = rng.choice([0, rng.randint(0, prompt - 1)])
            excluded = set(rng.sample([n for n, _ in PREFILL], rng.choice([0, 0, 0, 1, 2])))
            queues = ref_read_queues(accounting)
            # The read rate is learnt from finished reads: alpha moves during the replay.
            alpha = accounting.alpha_tokens(SCHEDULING.alpha_s)
            beta = accounting.beta_tokens(SCHEDULING.beta_s)
            expected_pe = ref_prefill(ref_candidates(accounting, "prefill", excluded), queues, alpha, beta)
            expected_de = ref_decode(ref_candidates(accounting, "decode", set()), prompt,
                                     SCHEDULING.de_token_threshold_factor) if expected_pe else None  # fmt: skip
            expected_side = ref_read_side(expected_pe, expected_de, queues) if expected_pe else None
            pes = dispatcher._candidates("prefill", excluded)
            seen["whole role" if pes is accounting.role("prefill") else "subset"] += 1
            placement = dispatcher.try_place(pes, prompt, hit, None)
            got = None if placement is None else (placement.prefill.name, placement.decode.name, placement.read_side)
            want = None if expected_pe is None else (expected_pe.name, expected_de.name, expected_side)
            assert got == want, f"placement differs: {got} != {want}"
            seen["queued" if placement is None else f"read on {placement.read_side}"] += 1
            if placement is not None:
                read_node = placement.read_node
                shadow.tokens[expected_pe.name] += prompt - hit
                shadow.requests[expected_pe.name] += 1
                shadow.tokens[expected_de.name] += prompt
                shadow.requests[expected_de.name] += 1
                shadow.read[read_node] += hit
                outstanding.append((placement, True))
        elif action < 0.8 and outstanding:
            i = rng.randrange(len(outstanding))
            placement, prefilling = outstanding[i]
            if prefilling:
                failed = rng.random() < 0.1
                dispatcher.finish_prefill(placement, completed=not failed, engine_failed=failed)
                shadow.tokens[placement.prefill.name] -= placement.prompt_tokens - placement.hit_tokens
                shadow.requests[placement.prefill.name] -= 1
                shadow.read[placement.read_node] -= placement.hit_tokens
                outstanding[i] = (placement, False)
            elif rng.random() < 0.15:
                # The DE failed: the request moves to another DE, chosen among the rest.
                old = placement.decode
                excluded = {old.name}
                old.healthy = False
                shadow.tokens[old.name] -= placement.prompt_tokens
                shadow.requests[old.name] -= 1
                candidates = ref_candidates(accounting, "decode", excluded)
                expected = ref_decode(candidates, placement.prompt_tokens, SCHEDULING.de_token_threshold_factor) \
                    if candidates else None  # fmt: skip
                old.healthy = True  # replace_decode marks it again itself
                moved = dispatcher.replace_decode(placement, excluded)
                assert (placement.decode.name if moved else None) == (expected.name if expected else None)
                seen["decode replaced"] += 1
                if moved:
                    shadow.tokens[expected.name] += placement.prompt_tokens
                    shadow.requests[expected.name] += 1
                else:
                    outstanding.pop(i)
            else:
                dispatcher.finish_decode(placement)
                shadow.tokens[placement.decode.name] -= placement.prompt_tokens
                shadow.requests[placement.decode.name] -= 1
                outstanding.pop(i)
        else:
            for engine in accounting.engines.values():
                if rng.random() < 0.5:
                    accounting.apply_report(engine, random_report(rng))
            seen["refresh"] += 1
        shadow.check(accounting)
        if check_books:
            check_node_totals(accounting)
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_placements_and_books_equal_the_per_engine_formulas(seed):
    seen = replay(seed, 600)
    # The replay reaches every branch it is meant to compare.
    for outcome in ("whole role", "subset", "queued", "read on pe", "read on de", "decode replaced", "refresh"):
        assert seen[outcome] > 0, (outcome, dict(seen))


def test_negative_control_a_wrong_group_total_changes_the_choice():
    def favour_last_decode_node(accounting: Accounting) -> None:
        accounting.books.tokens[("decode", "n6")] -= 10**9

    with pytest.raises(AssertionError, match="placement differs"):
        replay(0, 600, check_books=False, perturb=favour_last_decode_node)


def test_negative_control_a_wrong_read_queue_total_is_caught_in_the_books():
    def phantom_reads(accounting: Accounting) -> None:
        accounting.books.reported_read["n0"] += 1

    with pytest.raises(AssertionError, match="read queues differ"):
        replay(0, 50, perturb=phantom_reads)
