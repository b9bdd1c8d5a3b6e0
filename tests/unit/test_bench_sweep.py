"""APS at SLO (paper §7.4): online runs at increasing agent arrival rates until the SLO breaks, per mode."""

from __future__ import annotations

import pytest

from dualpath_bench import report
from dualpath_dev import compare
from dualpath_dev.compare import BenchConfig, BenchError, compare_runs


def _fake_runs(monkeypatch, holds_up_to: dict[str, float]) -> list[tuple[str, float, int]]:
    calls = []

    def run_mode(cluster, mode, agents, config, salt, watcher, bytes_per_token):
        calls.append((mode, config.rate, salt))
        holds = config.rate <= holds_up_to[mode]
        slo = {"holds": holds, "ttft_s": 1.0 if holds else 9.0, "tpot_s": 0.02, "percentile": 90.0,
               "ttft_limit_s": 4.0, "tpot_limit_s": 0.05}  # fmt: skip
        return {"mode": mode, "summary": {"slo": slo, "jct_s": 100.0, "agents_failed": 0}, "rate": config.rate}

    monkeypatch.setattr(compare, "_run_mode", run_mode)
    return calls


def test_the_sweep_stops_at_the_first_broken_rate_and_keeps_the_last_that_held(monkeypatch):
    calls = _fake_runs(monkeypatch, {"basic": 0.1, "dualpath": 0.2})
    config = BenchConfig(replay_mode="online", rates=(0.4, 0.05, 0.1, 0.2)).validate()
    basic = compare._run_or_sweep(None, "basic", [], config, 1, None, 2048.0)
    dual = compare._run_or_sweep(None, "dualpath", [], config, 2, None, 2048.0)

    assert [(s["rate"], s["holds"]) for s in basic["sweep"]] == [(0.05, True), (0.1, True), (0.2, False)]
    assert (basic["aps_at_slo"], basic["rate"]) == (0.1, 0.1)
    assert dual["aps_at_slo"] == 0.2 and [s["rate"] for s in dual["sweep"]] == [0.05, 0.1, 0.2, 0.4]
    # Every run in a prefix space of its own.
    assert len({salt for _, _, salt in calls}) == len(calls)
    comparison = compare_runs({"basic": basic, "dualpath": dual}, 2.0)
    assert comparison["aps_at_slo"] == {"basic": 0.1, "dualpath": 0.2}
    assert comparison["dualpath_aps_speedup"] == pytest.approx(2.0)


def test_nothing_held_reports_no_rate(monkeypatch):
    _fake_runs(monkeypatch, {"basic": 0.0})
    run = compare._run_or_sweep(None, "basic", [], BenchConfig(replay_mode="online", rates=(0.1, 0.2)), 1, None, 1.0)
    assert run["aps_at_slo"] is None and [s["rate"] for s in run["sweep"]] == [0.1]
    assert compare_runs({"basic": run}, 2.0)["dualpath_aps_speedup"] is None


@pytest.mark.parametrize("config", [BenchConfig(rates=(0.1,)), BenchConfig(replay_mode="online", rates=(0.1, 0.0))])
def test_rates_need_the_online_replay_and_positive_values(config):
    with pytest.raises(BenchError, match="bench.rates"):
        config.validate()


def test_the_report_names_the_rate_each_mode_held(monkeypatch):
    _fake_runs(monkeypatch, {"basic": 0.1, "dualpath": 0.2})
    config = BenchConfig(replay_mode="online", rates=(0.1, 0.2, 0.4))
    runs = {m: compare._run_or_sweep(None, m, [], config, i, None, 1.0) for i, m in enumerate(("basic", "dualpath"))}
    # The table rows need a whole run; the sweep lines only the comparison and the sweeps.
    rows = {m: {**run, "error": "not rendered here"} for m, run in runs.items()}
    payload = {
        "config": {"cluster": {"storage_mbit": 16.0, "compute_mbit": 0.0}, "replay_mode": "online"},
        "trace": {"agents": 2, "turns": 3.0, "append": 10.0, "gen": 5.0, "context": 100.0, "hit_ratio": 0.9},
        "topologies": [{"topology": "1P1D", "bound": 2.0, "runs": rows, "comparison": compare_runs(runs, 2.0)}],
    }
    text = report.markdown(payload)
    assert "agent arrivals per second at the SLO: basic 0.1/s, dualpath 0.2/s; DualPath/Basic 2.00x" in text
    assert "  - basic: 0.1/s held (TTFT 1.00 s), 0.2/s broke (TTFT 9.00 s)" in text


def _offline_payload(basic_agents_failed: int) -> dict:
    def run(jct_s: float, agents_failed: int = 0) -> dict:
        return {
            "summary": {"jct_s": jct_s, "ttft_s": {"p90": 2.0}, "tpot_s": {"p50": 0.03}, "read_sides": {"pe": 3},
                        "failed_requests": 0, "agents_done": 16 - agents_failed, "agents_failed": agents_failed},
            "ttft_breakdown": {}, "nic": {"max_over_avg": 1.0},
        }  # fmt: skip

    runs = {"basic": run(610.1, basic_agents_failed), "dualpath": run(561.2), "oracle": run(576.2)}
    return {
        "config": {"cluster": {"storage_mbit": 16.0, "compute_mbit": 0.0}, "replay_mode": "offline"},
        "trace": {"agents": 16, "turns": 8.0, "append": 10.0, "gen": 5.0, "context": 100.0, "hit_ratio": 0.9},
        "topologies": [{"topology": "2P1D", "bound": 1.5, "runs": runs, "comparison": compare_runs(runs, 1.5)}],
    }


def test_a_null_speedup_is_printed_as_none_with_the_unfinished_agents():
    payload = _offline_payload(basic_agents_failed=1)
    assert payload["topologies"][0]["comparison"]["dualpath_speedup"] is None
    text = report.markdown(payload)
    # Not the plain ratio of the two JCTs (610.1 / 561.2 = 1.09x, Basic / Oracle 1.06x): no ratio, and why.
    assert "1.09x" not in text and "1.06x" not in text
    assert "| 2P1D | dualpath | 561.2 | n/a: Basic finished 15 of 16 agents |" in text
    assert "| 2P1D | oracle | 576.2 | n/a: Basic finished 15 of 16 agents |" in text
    assert "- 2P1D: DualPath speedup n/a: Basic finished 15 of 16 agents (bound 1.50x)" in text


def test_a_recorded_speedup_is_printed():
    payload = _offline_payload(basic_agents_failed=0)
    comparison = payload["topologies"][0]["comparison"]
    # The report prints the comparison's field: set it apart from the JCTs' ratio to see which one is printed.
    comparison["dualpath_speedup"] = 1.23
    text = report.markdown(payload)
    assert "| 2P1D | dualpath | 561.2 | 1.23x |" in text
    assert "- 2P1D: DualPath speedup 1.23x of a 1.50x bound" in text
    assert f"| 2P1D | oracle | 576.2 | {comparison['basic_over_oracle']:.2f}x |" in text
    assert "n/a: Basic" not in text
