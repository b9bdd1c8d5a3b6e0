"""The discrete-event simulator (dualpath_bench.simulate): event order, byte conservation, the router's own policies."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import replace

import pytest

from dualpath_bench.errors import BenchUsageError
from dualpath_bench.simulate import experiments
from dualpath_bench.simulate.cluster import Simulation, Turn
from dualpath_bench.simulate.events import EventLoop
from dualpath_bench.simulate.hardware import preset
from dualpath_bench.simulate.prefill_steps import NodeStepper, PrefillSteps, _Prefill
from dualpath_bench.trace import TraceConfig, generate, turn_lengths
from dualpath_router.dispatcher import Dispatcher
from dualpath_router.policies import BasicPolicy, DualPathPolicy

# Storage-bound: the emulated cluster's 2 MB/s storage NICs against an 8k-context agent trace.
HW = preset("emulated")
AGENTS = turn_lengths(TraceConfig(agents=8, turns=8, first_append_tokens=2048, sigma=0.3))


def expected_saved_tokens(agents, block):
    """Whole blocks each turn stores: its prompt's after the hit (the PE) and those decoding completed (the DE)."""
    total = 0
    for turns in agents:
        context = 0
        for append, output in turns:
            hit = min(context, context + append - 1) // block * block
            total += (context + append + output - 1) // block * block - hit
            context += append + output
    return total


def expected_hit_tokens(agents, block):
    total = 0
    for turns in agents:
        context = 0
        for append, output in turns:
            total += min(context, context + append - 1) // block * block
            context += append + output
    return total


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    for when, tag in ((2.0, "c"), (1.0, "a"), (1.0, "b"), (0.5, "first")):
        loop.at(when, seen.append, tag)
    loop.at(1.0, lambda _: loop.at(1.0, seen.append, "scheduled-at-1-by-b"))
    assert loop.run() == 2.0
    assert seen == ["first", "a", "b", "scheduled-at-1-by-b", "c"]
    with pytest.raises(ValueError, match="past"):
        loop.at(1.0, seen.append, "late")


@pytest.mark.parametrize("mode", ["basic", "dualpath"])
def test_every_hit_byte_is_read_once_and_every_link_byte_is_accounted(mode):
    sim = Simulation(HW, 1, 2, mode)
    result = sim.run(AGENTS)
    hit = expected_hit_tokens(AGENTS, HW.block_tokens) * HW.kv_bytes_per_token
    assert result.turns == sum(map(len, AGENTS))
    assert result.hit_bytes == hit > 0
    pe_side, de_side = result.side_bytes["pe"], result.side_bytes["de"]
    assert pe_side + de_side == hit  # each hit read on exactly one side
    assert (de_side == 0) == (mode == "basic")
    by_kind: dict[str, float] = {}
    for link in sim.links():
        by_kind[link.kind] = by_kind.get(link.kind, 0.0) + link.bytes
    # Each link's bytes are the paper's per-path multiples (§4.2, Eqs. 1-8), summed over all requests.
    saved = expected_saved_tokens(AGENTS, HW.block_tokens) * HW.kv_bytes_per_token
    assert result.saved_bytes == saved
    assert by_kind == {
        "storage NIC, reads": hit,
        "storage NIC, writes": saved,
        "PE DRAM": 2 * pe_side,
        "DE DRAM": 2 * pe_side + 3 * de_side,
        "PE compute NIC, reads": 2 * pe_side,
        "PE compute NIC, writes": pe_side + de_side,
        "DE compute NIC, reads": pe_side + 2 * de_side,
        "DE compute NIC, writes": 2 * pe_side + de_side,
    }
    storage_pe = sum(n.storage.bytes for name, n in sim.nodes.items() if name.startswith("pe"))
    assert storage_pe == pe_side


def test_oracle_reads_nothing():
    sim = Simulation(HW, 1, 1, "oracle")
    result = sim.run(AGENTS)
    # Only the saves move bytes (the emulated Oracle saves too: the next turns' lookups find their chunks).
    assert result.hit_bytes == 0 and all(link.bytes == 0 for link in sim.links() if link.kind != "storage NIC, writes")
    assert result.saved_bytes == expected_saved_tokens(AGENTS, HW.block_tokens) * HW.kv_bytes_per_token


@pytest.mark.parametrize("pe_busy_until, de_busy_until, decode_may_read, moved", [
    (5.0, 0.0, True, True),     # the PE's link is busy, the DE's idle: the read moves
    (5.0, 6.0, True, False),    # the DE would finish it later: it stays
    (0.0, 0.0, True, False),    # the PE's link is idle: it stays (too short to split: under 2 x 1024 tokens)
    (5.0, 0.0, False, False),   # Basic: DEs never read
])  # fmt: skip
def test_a_pe_side_read_moves_to_the_de_when_that_finishes_it_sooner(pe_busy_until, de_busy_until, decode_may_read,
                                                                   moved):
    sim = Simulation(HW, 1, 1, "dualpath", split_read_min_tokens=1024)
    placement = sim.dispatcher.try_place(sim._pes, 1000, 960, None)
    placement.read_side, placement.decode_may_read = "pe", decode_may_read
    sim.nodes["pe0"].storage.free_at, sim.nodes["de0"].storage.free_at = pe_busy_until, de_busy_until
    sim._read(Turn(0, 0, 1000, 960, 10, placement))
    assert placement.read_side == ("de" if moved else "pe") and sim._moved_reads == int(moved)
    reader = sim.nodes["de0" if moved else "pe0"].storage
    assert reader.bytes == 960 * HW.kv_bytes_per_token  # read once, on one side


@pytest.mark.parametrize("pe_busy_until, de_busy_until, head_tokens", [
    (0.0, 0.0, 1984),   # both links idle: the hit is halved (in whole blocks of 32)
    (0.0, 60.0, 4000),  # the DE would finish its part later: all here
])  # fmt: skip
def test_a_long_pe_side_hit_is_split_across_both_links(pe_busy_until, de_busy_until, head_tokens):
    sim = Simulation(HW, 1, 1, "dualpath")
    placement = sim.dispatcher.try_place(sim._pes, 4100, 4000, None)
    placement.read_side, placement.decode_may_read = "pe", True
    sim.nodes["pe0"].storage.free_at, sim.nodes["de0"].storage.free_at = pe_busy_until, de_busy_until
    sim._read(Turn(0, 0, 4100, 4000, 10, placement))
    pe_read, de_read = sim.nodes["pe0"].storage.bytes, sim.nodes["de0"].storage.bytes
    # Every hit byte read once, on one of the two sides.
    assert (pe_read, de_read) == (head_tokens * HW.kv_bytes_per_token, (4000 - head_tokens) * HW.kv_bytes_per_token)
    assert sim._split_reads == int(head_tokens < 4000) and placement.read_side == "pe"


def test_a_turn_waits_for_the_chunks_it_will_hit_to_be_stored():
    nominal = Simulation(HW, 1, 1, "oracle").run(AGENTS).jct_s
    slower = Simulation(replace(HW, storage_bytes_per_s=HW.storage_bytes_per_s / 4), 1, 1, "oracle").run(AGENTS).jct_s
    # Oracle reads nothing: only the saves (the store waits) see the slower NIC, and they lengthen the run.
    assert slower > nominal


def test_the_policies_are_the_routers_own_objects(monkeypatch):
    sim = Simulation(HW, 1, 2, "dualpath")
    assert type(sim.dispatcher) is Dispatcher and type(sim.dispatcher.policy) is DualPathPolicy
    assert type(Simulation(HW, 1, 2, "basic").dispatcher.policy) is BasicPolicy
    # A change to the router's policy changes the simulation: every read moves to the DE side.
    monkeypatch.setattr(DualPathPolicy, "choose_read_side", lambda self, pe, de, accounting: "de")
    result = Simulation(HW, 1, 2, "dualpath").run(AGENTS)
    assert result.read_sides == {"pe": 0, "de": sum(map(len, AGENTS))}


def test_oracle_beats_dualpath_beats_basic_when_storage_bound():
    jct = {mode: Simulation(HW, 1, 1, mode).run(AGENTS).jct_s for mode in ("basic", "dualpath", "oracle")}
    assert jct["oracle"] < jct["dualpath"] < jct["basic"]
    # Two storage NICs instead of one: close to twice as fast while reads dominate.
    assert jct["basic"] / jct["dualpath"] > 1.4


def test_the_pd_range_ends_turn_a_link_into_the_bottleneck():
    check = experiments.pd_range_check(preset("paper"), agents_per_node=16)
    assert check["range"] == ["1/7", "7/2"]
    rows = {row["where"]: row for row in check["rows"]}
    for where in ("lower end, inside", "upper end, inside"):
        assert rows[where]["busiest"] == "storage NIC, reads", rows[where]["utilisation"]
    assert rows["lower end, outside"]["busiest"] == "PE compute NIC, writes", rows["lower end, outside"]["utilisation"]
    assert rows["upper end, outside"]["busiest"] in ("DE compute NIC, writes", "DE DRAM"), rows["upper end, outside"]
    for where in ("lower end, outside", "upper end, outside"):
        assert rows[where]["utilisation"]["storage NIC, reads"] < rows[where]["utilisation"][rows[where]["busiest"]]


def test_bad_settings_are_named():
    with pytest.raises(BenchUsageError, match="engines_per_node"):
        replace(HW, engines_per_node=3, gpus_per_node=8)
    with pytest.raises(BenchUsageError, match="topology '1P0D'"):
        experiments.parse_topology("1P0D")
    with pytest.raises(BenchUsageError, match="unknown mode"):
        Simulation(HW, 1, 1, "fastest")
    with pytest.raises(BenchUsageError, match="unknown preset"):
        preset("cloud")


def test_a_window_of_turns_reads_the_earlier_turns_as_history():
    agents = [turns[:5] for turns in AGENTS]
    whole = Simulation(HW, 1, 1, "basic").run(agents)
    window = Simulation(HW, 1, 1, "basic").run(agents, first_turn=3)
    assert window.turns == sum(max(0, len(t) - 3) for t in agents) < whole.turns
    # The window's hits are the same turns' hits of the whole run: the history counts as stored context.
    per_turn = [min(c, c + a - 1) // HW.block_tokens * HW.block_tokens
                for turns in agents for i, (a, _) in enumerate(turns) if i >= 3
                for c in [sum(x + y for x, y in turns[:i])]]  # fmt: skip
    assert window.hit_bytes == sum(per_turn) * HW.kv_bytes_per_token


def test_one_pass_read_queues_equal_each_nodes_read_queue_tokens():
    # Accounting.read_queues was rewritten as one pass for the simulator's 1152-engine clusters: same answers.
    accounting = Simulation(HW, 2, 3, "dualpath").dispatcher.accounting
    for i, engine in enumerate(accounting.engines.values()):
        engine.reported_read_queue_tokens = 100 * i
        engine.reported_requests = i % 2 or None  # only stepping engines' reports count
        accounting.dispatched_read_tokens[engine.node] += 7 * i
    queues = accounting.read_queues()
    assert queues == {node: accounting.read_queue_tokens(node) for node in accounting.nodes()}
    assert len(set(queues.values())) > 1  # the comparison is not between all-zero books


# --- the compute quota: PE nodes stepping in lockstep (dualpath_bench/simulate/prefill_steps.py) ---------

# The paper's hardware with a lighter trace: many agents, so PEs queue prefills of different lengths.
PAPER = preset("paper")
QUOTA_AGENTS = turn_lengths(replace(experiments.PAPER_TRACE, agents=256, turns=6))


def stepper(hw, settings):
    return NodeStepper(hw, settings, EventLoop(), {"pe0": ["pe0.0"]}, lambda turn: None)


def test_a_quota_step_is_the_largest_chunk_under_the_quota_fifo():
    plan = stepper(PAPER, PrefillSteps(16384, quota_s=0.3)).plan
    fits_whole, long = _Prefill("a", 400, 30_000), _Prefill("b", 16_000, 0)
    chosen = plan(deque([fits_whole, long, _Prefill("c", 10, 0)]))
    assert [p.turn for p, _ in chosen] == ["a", "b"]  # FIFO; "c" waits behind the chunked one
    assert chosen[0][1] == 400
    used = PAPER.prefill_s(400, 30_000)
    chunk = chosen[1][1]
    assert used + PAPER.prefill_s(chunk, 0) <= 0.3 < used + PAPER.prefill_s(chunk + 1, 0)
    # Without the quota only the token budget cuts; with it, a prefill that alone exceeds it gets the floor.
    assert [n for _, n in stepper(PAPER, PrefillSteps(16384)).plan(deque([long]))] == [16_000]
    assert [n for _, n in stepper(PAPER, PrefillSteps(16384, quota_s=1e-6)).plan(deque([long]))] == [PAPER.block_tokens]


def test_quota_bounds_node_steps_and_shrinks_bubbles_with_every_turn_done():
    # Whole reads: on this short trace, split reads change when prefills arrive enough to move the bubble
    # fraction either way (0.191 with the quota, 0.187 without), which is not what this test is about.
    runs = {quota: Simulation(PAPER, 1, 1, "dualpath", prefill_steps=PrefillSteps(16384, quota),
                              split_read_min_tokens=0).run(QUOTA_AGENTS)
            for quota in (None, 0.3)}  # fmt: skip
    plain = Simulation(PAPER, 1, 1, "dualpath", split_read_min_tokens=0).run(QUOTA_AGENTS)
    for result in runs.values():
        assert result.turns == plain.turns == sum(map(len, QUOTA_AGENTS))
        assert result.hit_bytes == plain.hit_bytes  # stepping changes compute, never what is read
    with_quota, without = runs[0.3].prefill_steps, runs[None].prefill_steps
    assert with_quota["step_max_s"] <= 0.3 < without["step_max_s"]  # the negative control exceeds it
    assert with_quota["bubble_fraction"] < without["bubble_fraction"]
    assert plain.prefill_steps == {}


def test_prefill_step_settings_are_checked():
    with pytest.raises(BenchUsageError, match="token_budget"):
        PrefillSteps(0)
    with pytest.raises(BenchUsageError, match="compute quota"):
        PrefillSteps(1024, quota_s=0.0)


def test_calibration_fits_the_oracle_then_predicts_the_others(tmp_path):
    trace = {"agents": 4, "turns": 4, "first_append_tokens": 1024, "sigma": 0.3}
    agents = turn_lengths(TraceConfig.from_dict(trace))
    # A "measured" run: the simulator's own JCTs with a 2 s per-turn overhead the preset does not have.
    truth = replace(HW, request_overhead_s=2.0)
    runs = {mode: {"summary": {"jct_s": Simulation(truth, 1, 1, mode).run(agents).jct_s, "hit_tokens": 0}}
            for mode in ("basic", "dualpath", "oracle")}  # fmt: skip
    payload = {"config": {"cluster": {"storage_mbit": HW.storage_bytes_per_s * 8 / 1e6}}, "trace_config": trace,
               "topologies": [{"topology": "1P1D", "runs": runs}]}  # fmt: skip
    (tmp_path / "dualpath-bench.json").write_text(json.dumps(payload))
    rows = {row["mode"]: row for row in experiments.calibration(HW, [tmp_path / "dualpath-bench.json"], {})}
    assert rows["oracle"]["fitted"] and rows["oracle"]["overhead_s"] == pytest.approx(2.0, abs=0.05)
    for mode in ("basic", "dualpath"):
        assert not rows[mode]["fitted"] and abs(rows[mode]["error"]) < 0.02


def test_calibration_also_predicts_each_mode_at_its_own_measured_read_rate(tmp_path):
    trace = {"agents": 4, "turns": 4, "first_append_tokens": 1024, "sigma": 0.3}
    # The trace the calibration replays (generate's turns: turn_lengths draws other counts for the same seed).
    agents = [[(len(t.append), t.output_tokens) for t in a.turns] for a in generate(TraceConfig.from_dict(trace))]
    rate = HW.storage_bytes_per_s / HW.kv_bytes_per_token
    # DualPath's reads ran at half the link's rate (both sides' medians average to it); Basic reported none.
    slower = replace(HW, storage_bytes_per_s=HW.storage_bytes_per_s / 2)
    runs = {"basic": {"summary": {"jct_s": Simulation(HW, 1, 1, "basic").run(agents).jct_s, "hit_tokens": 0}},
            "dualpath": {"summary": {"jct_s": Simulation(slower, 1, 1, "dualpath").run(agents).jct_s, "hit_tokens": 0},
                         "link_use": {"read_tokens_per_s_median": {"own": rate * 0.4, "for_peer": rate * 0.6}}},
            "oracle": {"summary": {"jct_s": Simulation(HW, 1, 1, "oracle").run(agents).jct_s, "hit_tokens": 0}}}  # fmt: skip
    payload = {"config": {"cluster": {"storage_mbit": HW.storage_bytes_per_s * 8 / 1e6}}, "trace_config": trace,
               "topologies": [{"topology": "1P1D", "runs": runs}]}  # fmt: skip
    (tmp_path / "dualpath-bench.json").write_text(json.dumps(payload))
    rows = {row["mode"]: row for row in experiments.calibration(HW, [tmp_path / "dualpath-bench.json"], {})}
    assert "own_rate_jct_s" not in rows["basic"]
    dualpath = rows["dualpath"]
    assert dualpath["own_read_tokens_per_s"] == pytest.approx(rate / 2)
    # At the link's nominal rate the prediction misses the slower reads; at the run's own rate it matches.
    assert dualpath["error"] < -0.1 and abs(dualpath["own_rate_error"]) < 0.01


def test_calibration_takes_the_links_rate_where_reads_overlapped_and_leaves_out_runs_without_an_oracle(tmp_path):
    trace = {"agents": 4, "turns": 4, "first_append_tokens": 1024, "sigma": 0.3}
    agents = [[(len(t.append), t.output_tokens) for t in a.turns] for a in generate(TraceConfig.from_dict(trace))]
    rate = HW.storage_bytes_per_s / HW.kv_bytes_per_token
    at_90 = replace(HW, storage_bytes_per_s=HW.storage_bytes_per_s * 0.9)
    # Two reads in flight per link: each read got under half the link, the link 90% of its rate while it read.
    link_use = {"read_tokens_per_s_median": {"own": rate * 0.45},
                "per_link": {"pe0": {"rate_while_busy": 0.9}, "de0": {"rate_while_busy": None}}}  # fmt: skip
    runs = {"basic": {"summary": {"jct_s": Simulation(at_90, 1, 1, "basic").run(agents).jct_s, "hit_tokens": 0},
                      "link_use": link_use},
            "oracle": {"summary": {"jct_s": Simulation(HW, 1, 1, "oracle").run(agents).jct_s, "hit_tokens": 0}}}  # fmt: skip
    payload = {"config": {"cluster": {"storage_mbit": HW.storage_bytes_per_s * 8 / 1e6}}, "trace_config": trace,
               "topologies": [{"topology": "1P1D", "runs": runs}]}  # fmt: skip
    path = tmp_path / "dualpath-bench.json"
    path.write_text(json.dumps(payload))
    basic = {row["mode"]: row for row in experiments.calibration(HW, [path], {})}["basic"]
    assert basic["storage_bytes_per_s"] == pytest.approx(HW.storage_bytes_per_s * 0.9)
    assert abs(basic["error"]) < 0.03  # the fitted overhead is a bisection's
    # Control: the per-read median alone (a run before per-link rates) reads the link as half as fast.
    del link_use["per_link"]
    path.write_text(json.dumps(payload))
    assert {row["mode"]: row for row in experiments.calibration(HW, [path], {})}["basic"]["error"] > 0.2
    # Without an Oracle nothing is fitted, and nothing is predicted.
    del runs["oracle"]
    path.write_text(json.dumps(payload))
    assert experiments.calibration(HW, [path], {}) == []
