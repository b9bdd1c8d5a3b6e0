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


# --- repetitions ---------------------------------------------------------------------------------


def _run(jct_s: float, read_span_s: float, combined: float, agents_failed: int = 0) -> dict:
    return {
        "summary": {"jct_s": jct_s, "ttft_s": {"p90": 2.0}, "tpot_s": {"p50": 0.03}, "read_sides": {"pe": 3},
                    "failed_requests": 0, "agents_done": 16 - agents_failed, "agents_failed": agents_failed},
        "ttft_breakdown": {}, "nic": {"max_over_avg": 1.0, "series": {"t": [0.0, 1.0], "read_bytes": {"pe0": [0, 9]}}},
        "link_use": {"read_span_s": read_span_s, "combined_rate_fraction": combined},
    }  # fmt: skip


class _FakeCluster:
    """What run_topology touches of an EmulatedCluster: engine starts are recorded, nothing is started."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.network = type("Network", (), {"prefix": "t"})()
        self.s3 = type("S3", (), {"endpoint": "http://s3"})()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def start_engines(self, spec) -> None:
        self.events.append(("engines", spec.name))


def _fake_topology(monkeypatch, jct: dict[str, list[float]]) -> list:
    """run_topology over a fake cluster; each mode's runs take the next JCT of ``jct[mode]``."""
    events: list = []
    left = {mode: list(values) for mode, values in jct.items()}

    def run_mode(cluster, mode, agents, config, salt, watcher, bytes_per_token):
        events.append((mode, salt))
        jct_s = left[mode].pop(0)
        return {**_run(jct_s, jct_s / 2, 0.8), "mode": mode}

    watcher = type("Watcher", (), {"close": lambda self: events.append(("watcher closed",))})
    monkeypatch.setattr(compare, "EmulatedCluster", lambda *a, **k: _FakeCluster(events))
    monkeypatch.setattr(compare, "_watcher", lambda cluster: (watcher(), 2048.0))
    monkeypatch.setattr(compare, "_run_mode", run_mode)
    return events


def test_repetitions_interleave_the_modes_each_in_a_prefix_space_of_its_own(monkeypatch, tmp_path):
    events = _fake_topology(monkeypatch, {"basic": [300, 330, 310], "dualpath": [200, 180, 220]})
    config = BenchConfig(modes=("basic", "dualpath"), repeats=3).validate()
    result = compare.run_topology("1P1D", [], config, tmp_path, tmp_path)

    runs = [e for e in events if e[0] in ("basic", "dualpath")]
    assert [mode for mode, _ in runs] == ["basic", "dualpath"] * 3  # A B A B A B, not A A A B B B
    assert len({salt for _, salt in runs}) == 6
    assert events.count(("engines", "io")) == 1  # Basic and DualPath share their engines
    # Paired per repetition: 300/200, 330/180, 310/220; the median ratio, not the ratio of the medians (310/200).
    comparison = result["comparison"]
    assert comparison["dualpath_speedup"] == pytest.approx(1.5)
    assert comparison["spread"]["dualpath_speedup"]["min"] == pytest.approx(310 / 220)
    assert comparison["spread"]["dualpath_speedup"]["max"] == pytest.approx(330 / 180)
    assert comparison["repetitions"] == 3
    assert result["figures"]["dualpath"]["jct_s"] == {"median": 200, "min": 180, "max": 220, "values": [200, 180, 220]}
    assert result["runs"]["basic"]["summary"]["jct_s"] == 310  # the median-JCT repetition is the table's row


def test_with_the_oracle_every_repetition_starts_the_plain_engines_again(monkeypatch, tmp_path):
    events = _fake_topology(monkeypatch, {"basic": [3, 3], "dualpath": [2, 2], "oracle": [1, 1]})
    compare.run_topology("1P1D", [], BenchConfig(repeats=2).validate(), tmp_path, tmp_path)
    steps = [e[0] if e[0] != "engines" else f"engines:{e[1]}" for e in events if e[0] != "watcher closed"]
    assert steps == ["engines:io", "basic", "dualpath", "engines:oracle", "oracle"] * 2


def test_a_failed_repetition_leaves_the_ratio_unset_and_its_run_in_the_table():
    good = [{"basic": _run(300, 250, 0.5), "dualpath": _run(200, 150, 0.8)} for _ in range(2)]
    failed = {"basic": _run(300, 250, 0.5), "dualpath": _run(900, 150, 0.8, agents_failed=2)}
    comparison = compare.compare_repetitions([*good, failed], 2.0)
    # Two good repetitions say 1.5x; the third could not say anything, and a median of two would hide that.
    assert comparison["dualpath_speedup"] is None and comparison["read_span_speedup"] is None
    assert compare.representative([r["dualpath"] for r in (*good, failed)]) is failed["dualpath"]
    control = compare.compare_repetitions(good, 2.0)
    assert control["dualpath_speedup"] == pytest.approx(1.5)
    assert control["read_span_speedup"] == pytest.approx(250 / 150)
    assert control["fraction_of_read_span_bound"] == pytest.approx(250 / 150 / 2)


def test_the_report_gives_medians_and_spread_over_repetitions(monkeypatch, tmp_path):
    _fake_topology(monkeypatch, {"basic": [300, 330, 310], "dualpath": [200, 180, 220]})
    topology = compare.run_topology("1P1D", [], BenchConfig(modes=("basic", "dualpath"), repeats=3).validate(),
                                    tmp_path, tmp_path)  # fmt: skip
    payload = {
        "config": {"cluster": {"storage_mbit": 16.0, "compute_mbit": 0.0}, "replay_mode": "offline"},
        "trace": {"agents": 16, "turns": 8.0, "append": 10.0, "gen": 5.0, "context": 100.0, "hit_ratio": 0.9},
        "topologies": [topology],
    }
    text = report.markdown(payload)
    assert "| 1P1D | dualpath | 200.0 [180.0-220.0] | 1.50x | 2.00x |" in text
    assert "| 100 [90-110] | 80% [80-80%] |" in text
    assert "DualPath speedup 1.50x [1.41x-1.83x] of a 2.00x bound (75%); over the read span 1.50x [1.41x-1.83x] (75% of" in text
    assert "medians of 3 interleaved repetitions" in text
    assert report.plot(payload, tmp_path / "plot.png") is not None


def test_repeats_must_be_positive():
    with pytest.raises(BenchError, match="bench.repeats"):
        BenchConfig(repeats=0).validate()


def test_the_report_gives_each_links_rate_over_the_read_span_and_while_it_read():
    payload = _offline_payload(basic_agents_failed=0)
    payload["topologies"][0]["runs"]["dualpath"]["link_use"] = {"per_link": {
        "pe0": {"busy_s": 10.0, "rate_over_read_span": 0.81, "rate_while_busy": 0.9},
        "de0": {"busy_s": 8.0, "rate_over_read_span": 0.7, "rate_while_busy": None}}}  # fmt: skip
    text = report.markdown(payload)
    assert "- 2P1D dualpath: each link's rate moved over the read span (while it read): pe0 81% (90%), de0 70% (n/a)." in text
