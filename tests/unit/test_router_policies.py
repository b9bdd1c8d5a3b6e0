"""Router policies and the dispatcher's queue on constructed engine states (paper §6.1)."""

from __future__ import annotations

import asyncio

import pytest

from dualpath_router.accounting import Accounting, EngineLoad, ThroughputEstimate, parse_engine_metrics
from dualpath_router.config import EngineConfig, parse_router_config
from dualpath_router.dispatcher import Dispatcher, QueueFull, QueueTimeout
from dualpath_router.lookup import HitLookup
from dualpath_router.policies import (
    BasicPolicy,
    RoundRobinPolicy,
    make_policy,
    select_decode_dualpath,
    select_prefill_dualpath,
    select_read_side,
)


def engine(name: str, node: str, role: str = "prefill", tokens: int = 0, requests: int = 0,
           kv_usage: float | None = None, kv_capacity_tokens: int | None = None) -> EngineLoad:
    load = EngineLoad(EngineConfig(name, f"http://127.0.0.1:1/{name}", node, "127.0.0.1:1"), role)
    load.dispatched_tokens, load.dispatched_requests = tokens, requests
    load.kv_usage, load.kv_capacity_tokens = kv_usage, kv_capacity_tokens
    return load


ALPHA, BETA = 1000, 5000


class TestAlgorithm1:
    def test_overloaded_pe_is_skipped_even_on_an_idle_node(self):
        overloaded = engine("a", "n1", tokens=BETA + 1)
        busy_node = engine("b", "n2", tokens=4000)
        chosen = select_prefill_dualpath([overloaded, busy_node], {"n1": 0, "n2": ALPHA * 10}, ALPHA, BETA)
        assert chosen is busy_node

    def test_short_read_queue_preferred_over_fewer_tokens(self):
        long_queue = engine("a", "n1", tokens=100)
        short_queue = engine("b", "n2", tokens=3000)
        chosen = select_prefill_dualpath([long_queue, short_queue], {"n1": ALPHA + 1, "n2": ALPHA}, ALPHA, BETA)
        assert chosen is short_queue

    def test_least_tokens_wins_within_a_category(self):
        pes = [engine("a", "n1", tokens=300), engine("b", "n2", tokens=100), engine("c", "n3", tokens=200)]
        assert select_prefill_dualpath(pes, {}, ALPHA, BETA).name == "b"
        # All on long read queues: category 3, least tokens again.
        queues = {"n1": 2 * ALPHA, "n2": 2 * ALPHA, "n3": 2 * ALPHA}
        assert select_prefill_dualpath(pes, queues, ALPHA, BETA).name == "b"

    def test_beta_is_inclusive_alpha_is_inclusive(self):
        at_limits = engine("a", "n1", tokens=BETA)
        assert select_prefill_dualpath([at_limits], {"n1": ALPHA}, ALPHA, BETA) is at_limits

    def test_all_pes_over_beta_means_queue(self):
        pes = [engine("a", "n1", tokens=BETA + 1), engine("b", "n2", tokens=BETA * 2)]
        assert select_prefill_dualpath(pes, {}, ALPHA, BETA) is None


class TestDecodeScheduling:
    def test_phase1_picks_the_group_with_fewest_tokens(self):
        des = [engine("a1", "na", "decode", tokens=300), engine("a2", "na", "decode", tokens=300),
               engine("b1", "nb", "decode", tokens=500), engine("b2", "nb", "decode", tokens=0)]
        # Group na holds 600 tokens, nb 500: nb, although a1/a2 are not the busiest single engines.
        assert select_decode_dualpath(des, 100, 1.05).node == "nb"

    def test_phase2_fewest_requests_below_threshold(self):
        # Z = 1.05 x (100 + 100 + 100 + 400) / 3 = 245: "c" (400 + 100) is high-token.
        des = [engine("a", "n", "decode", tokens=100, requests=5),
               engine("b", "n", "decode", tokens=100, requests=1),
               engine("c", "n", "decode", tokens=400, requests=0)]
        assert select_decode_dualpath(des, 100, 1.05).name == "b"

    def test_phase2_all_high_token_picks_fewest_tokens(self):
        # Z = 1.05 x (300 + 100 + 90 + 95) / 3 = 204.75: every DE is above it with the request.
        des = [engine("a", "n", "decode", tokens=100, requests=0),
               engine("b", "n", "decode", tokens=90, requests=9),
               engine("c", "n", "decode", tokens=95, requests=1)]
        assert select_decode_dualpath(des, 300, 1.05).name == "b"

    def test_phase2_skips_des_without_free_kv_memory(self):
        full = engine("a", "n", "decode", tokens=0, requests=0, kv_usage=0.95, kv_capacity_tokens=1000)
        roomy = engine("b", "n", "decode", tokens=0, requests=3, kv_usage=0.1, kv_capacity_tokens=1000)
        assert select_decode_dualpath([full, roomy], 200, 1.05) is roomy

    def test_no_de_with_room_goes_to_the_most_free_memory(self):
        fuller = engine("a", "n", "decode", kv_usage=0.99, kv_capacity_tokens=1000)
        emptier = engine("b", "n", "decode", kv_usage=0.9, kv_capacity_tokens=1000)
        assert select_decode_dualpath([fuller, emptier], 500, 1.05) is emptier


def test_read_side_is_the_shorter_queue_pe_on_tie():
    pe, de = engine("p", "np"), engine("d", "nd", "decode")
    assert select_read_side(pe, de, {"np": 500, "nd": 100}) == "de"
    assert select_read_side(pe, de, {"np": 100, "nd": 500}) == "pe"
    assert select_read_side(pe, de, {"np": 100, "nd": 100}) == "pe"
    colocated = engine("d2", "np", "decode")
    assert select_read_side(pe, colocated, {"np": 999}) == "pe"


def test_round_robin_cycles_engines_and_read_sides():
    policy = RoundRobinPolicy()
    pes = [engine("a", "n1", tokens=0), engine("b", "n2", tokens=10**9)]
    des = [engine("x", "n3", "decode"), engine("y", "n4", "decode")]
    accounting = Accounting.build([], [], 1.0, 1.0, 0.5)
    assert [policy.choose_prefill(pes, accounting, 1).name for _ in range(4)] == ["a", "b", "a", "b"]
    assert [policy.choose_decode(des, accounting, 1).name for _ in range(3)] == ["x", "y", "x"]
    assert [policy.choose_read_side(pes[0], des[0], accounting) for _ in range(3)] == ["pe", "de", "pe"]


def test_basic_least_tokens_and_pe_reads():
    policy = BasicPolicy()
    accounting = Accounting.build([], [], 1.0, 1.0, 0.5)
    pes = [engine("a", "n1", tokens=10**9), engine("b", "n2", tokens=5)]
    des = [engine("x", "n3", "decode", tokens=7), engine("y", "n4", "decode", tokens=3)]
    assert policy.choose_prefill(pes, accounting, 1).name == "b"  # never queues, even over beta
    assert policy.choose_decode(des, accounting, 1).name == "y"
    assert policy.choose_read_side(pes[0], des[0], accounting) == "pe"


def test_throughput_estimate_charges_concurrent_work_once(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("dualpath_router.accounting.time.monotonic", lambda: clock[0])
    estimate = ThroughputEstimate(initial_tokens_per_s=1000.0, weight=1.0)
    estimate.started("pe0")
    estimate.started("pe0")
    clock[0] = 2.0
    estimate.finished("pe0", 4000, completed=True)  # busy 0..2 s: 2000 tokens/s
    assert estimate.tokens_per_s == pytest.approx(2000.0)
    clock[0] = 2.5
    estimate.finished("pe0", 2000, completed=True)  # charged 2.0..2.5 only
    assert estimate.tokens_per_s == pytest.approx(4000.0)
    estimate.started("pe0")
    clock[0] = 10.0
    estimate.finished("pe0", 10, completed=False)  # failures teach nothing
    assert estimate.tokens_per_s == pytest.approx(4000.0)


def make_dispatcher(policy: str = "dualpath", **scheduling) -> Dispatcher:
    config = parse_router_config({
        "served_model_names": ["m"],
        "vocab_size": 1024,
        "policy": policy,
        "prefill_engines": [{"name": "pe0", "url": "http://127.0.0.1:1", "node": "n1"},
                            {"name": "pe1", "url": "http://127.0.0.1:2", "node": "n2"}],
        "decode_engines": [{"name": "de0", "url": "http://127.0.0.1:3", "node": "n3",
                            "side_channel": "127.0.0.1:4"}],
        # beta = 1 s x 1000 tokens/s = 1000 tokens per PE.
        "scheduling": {"beta_s": 1.0, "prefill_tokens_per_s": 1000.0, "alpha_s": 1.0,
                       "read_tokens_per_s": 1000.0, **scheduling},
    })
    accounting = Accounting.build(config.prefill_engines, config.decode_engines, 1000.0, 1000.0, 0.2)
    return Dispatcher(config, accounting, make_policy(config.policy, config.scheduling), HitLookup(None, 10))


def test_overload_queues_in_fifo_order_until_accounting_changes():
    async def scenario():
        dispatcher = make_dispatcher()
        # Both PEs over beta after two large requests.
        first = await dispatcher.start_prefill(1500, 0, set(), None)
        second = await dispatcher.start_prefill(1500, 0, set(), None)
        assert {first.prefill.name, second.prefill.name} == {"pe0", "pe1"}

        waiting = [asyncio.create_task(dispatcher.start_prefill(n, 0, set(), None)) for n in (10, 20)]
        await asyncio.sleep(0)  # let both enter the queue
        assert dispatcher.queued_requests == 2 and not any(t.done() for t in waiting)

        dispatcher.finish_prefill(first, completed=True)
        placed = await asyncio.wait_for(waiting[0], 5)
        assert placed.prefill is first.prefill and placed.prompt_tokens == 10
        # The same PE is still under beta for the next one in line.
        placed_next = await asyncio.wait_for(waiting[1], 5)
        assert placed_next.prefill is first.prefill
        assert dispatcher.queued_requests == 0
        assert first.prefill.unfinished_tokens == 30

    asyncio.run(scenario())


def test_queue_timeout():
    async def scenario():
        dispatcher = make_dispatcher(queue_timeout_s=0.2)
        for _ in range(2):
            await dispatcher.start_prefill(1500, 0, set(), None)
        with pytest.raises(QueueTimeout):
            await dispatcher.start_prefill(10, 0, set(), None)
        assert dispatcher.queued_requests == 0

    asyncio.run(scenario())


def test_a_full_queue_refuses_at_once_and_a_leaving_request_wakes_the_next():
    async def scenario():
        dispatcher = make_dispatcher(max_queued_requests=2, queue_timeout_s=30.0)
        placed = [await dispatcher.start_prefill(1500, 0, set(), None) for _ in range(2)]  # both PEs over beta
        waiting = [asyncio.create_task(dispatcher.start_prefill(n, 0, set(), None)) for n in (10, 20)]
        await asyncio.sleep(0)
        assert dispatcher.queued_requests == 2
        with pytest.raises(QueueFull):
            await dispatcher.start_prefill(30, 0, set(), None)
        # The head gives up (its client went away): the next in line becomes the head and is placed on a change.
        waiting[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        assert dispatcher.queued_requests == 1
        dispatcher.finish_prefill(placed[0], completed=True)
        assert (await asyncio.wait_for(waiting[1], 5)).prompt_tokens == 20
        assert dispatcher.queued_requests == 0

    asyncio.run(scenario())


def test_booking_balances_and_read_queue_goes_to_the_chosen_side():
    async def scenario():
        dispatcher = make_dispatcher()
        accounting = dispatcher.accounting
        accounting.engines["pe0"].reported_read_queue_tokens = 5000  # n1's storage NIC is busy
        accounting.engines["pe0"].reported_requests = 3
        placement = await dispatcher.start_prefill(100, 64, {"pe1"}, None)
        assert (placement.prefill.name, placement.decode.name, placement.read_side) == ("pe0", "de0", "de")
        assert accounting.read_queue_tokens("n3") == 64
        assert accounting.engines["de0"].unfinished_tokens == 100
        dispatcher.finish_prefill(placement, completed=True)
        dispatcher.finish_decode(placement)
        assert accounting.read_queue_tokens("n3") == 0
        assert all(e.unfinished_tokens == 0 and e.dispatched_requests == 0 for e in accounting.engines.values())
        # Every PE failed this request: nothing to place.
        assert await dispatcher.start_prefill(100, 0, {"pe0", "pe1"}, None) is None

    asyncio.run(scenario())


def test_pe_holds_the_tokens_it_computes_and_the_read_node_the_hit():
    async def scenario():
        dispatcher = make_dispatcher()
        accounting = dispatcher.accounting
        # beta is 1000 tokens per PE: four mostly-hit 3000-token prompts all fit on
        # the PEs at once, their reads wait in the read queues instead.
        placements = [await dispatcher.start_prefill(3000, 2900, set(), None) for _ in range(4)]
        assert dispatcher.queued_requests == 0
        assert sorted(e.unfinished_tokens for e in accounting.role("prefill")) == [200, 200]
        assert sum(accounting.read_queues().values()) == 4 * 2900
        assert accounting.engines["de0"].unfinished_tokens == 4 * 3000
        for placement in placements:
            dispatcher.finish_prefill(placement, completed=True)
        assert all(e.unfinished_tokens == 0 for e in accounting.role("prefill"))

    asyncio.run(scenario())


def pe_metrics(computed_tokens: float, prefill_seconds: float) -> str:
    return (
        "# TYPE vllm:request_prefill_kv_computed_tokens histogram\n"
        f'vllm:request_prefill_kv_computed_tokens_sum{{engine="0"}} {computed_tokens}\n'
        "# TYPE vllm:request_prefill_time_seconds histogram\n"
        f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {prefill_seconds}\n'
    )


def test_prefill_rate_is_learnt_from_the_pes_compute_counters():
    accounting = Accounting.build([EngineConfig("pe0", "http://127.0.0.1:1", "n1")], [], 1000.0, 1000.0, 1.0)
    pe = accounting.engines["pe0"]
    accounting.apply_report(pe, parse_engine_metrics(pe_metrics(5000, 10)))  # baseline only
    assert accounting.prefill_rate.tokens_per_s == pytest.approx(1000.0)
    accounting.apply_report(pe, parse_engine_metrics(pe_metrics(5600, 10.5)))
    assert accounting.prefill_rate.tokens_per_s == pytest.approx(1200.0)
    assert accounting.beta_tokens(5.0) == pytest.approx(6000.0)
    # An engine restart resets its counters: re-baseline, learn nothing from it.
    accounting.apply_report(pe, parse_engine_metrics(pe_metrics(100, 1.0)))
    assert accounting.prefill_rate.tokens_per_s == pytest.approx(1200.0)
    accounting.apply_report(pe, parse_engine_metrics(pe_metrics(400, 1.5)))
    assert accounting.prefill_rate.tokens_per_s == pytest.approx(600.0)


def test_an_idle_engines_read_queue_gauge_is_stale_and_ignored():
    accounting = Accounting.build([EngineConfig("pe0", "http://127.0.0.1:1", "n1")],
                                  [EngineConfig("de0", "http://127.0.0.1:2", "n2")], 1000.0, 1000.0, 0.2)  # fmt: skip
    de = accounting.engines["de0"]
    de.reported_read_queue_tokens, de.reported_requests = 4000, 0  # its last step's value
    accounting.dispatched_read_tokens["n2"] = 300
    assert accounting.read_queue_tokens("n2") == 300
    de.reported_requests = 1  # stepping: the gauge is current and may count reads the router did not send
    assert accounting.read_queue_tokens("n2") == 4000
