"""dualpath-bench at several store round trips: the config's checks, one cluster per RTT, the report's RTT column."""

from __future__ import annotations

import pytest

from dualpath_bench import report
from dualpath_dev.bench_cluster import parser
from dualpath_dev import compare
from dualpath_dev.cluster import ClusterConfig, ClusterError
from dualpath_dev.compare import BenchConfig
from tests.unit.test_bench_sweep import _fake_topology


@pytest.mark.parametrize("rtt", [-1.0, float("nan"), float("inf")])
def test_a_store_rtt_that_is_not_a_number_at_least_0_is_refused_by_name(rtt):
    with pytest.raises(ClusterError, match=r"cluster.store_rtt_ms must be a number >= 0 \(0: no relay\)"):
        ClusterConfig(store_rtt_ms=rtt).validate()
    with pytest.raises(ClusterError, match="cluster.store_rtt_ms"):
        BenchConfig(store_rtts_ms=(0.0, rtt)).validate()  # every RTT of a sweep is checked before a cluster starts


def test_store_rtts_of_0_and_more_are_taken():
    assert ClusterConfig(store_rtt_ms=0.0).validate().store_rtt_ms == 0.0
    assert ClusterConfig(store_rtt_ms=20.0).validate().store_rtt_ms == 20.0
    config = BenchConfig(cluster=ClusterConfig(storage_mbit=8.0), store_rtts_ms=(0.0, 5.0, 20.0)).validate()
    assert [(c.store_rtt_ms, c.storage_mbit) for c in config.clusters()] == [(0.0, 8.0), (5.0, 8.0), (20.0, 8.0)]
    # Without a sweep the cluster's own RTT is the one run.
    assert [c.store_rtt_ms for c in BenchConfig(cluster=ClusterConfig(store_rtt_ms=5.0)).clusters()] == [5.0]


def test_the_command_line_takes_several_store_rtts():
    assert parser().parse_args(["--store-rtt-ms", "0", "5", "20"]).store_rtt_ms == [0.0, 5.0, 20.0]
    assert parser().parse_args([]).store_rtt_ms == []


def _rtt_payload(monkeypatch, tmp_path) -> tuple[dict, list[float]]:
    """run_comparison at 0, 5 and 20 ms over fake clusters (no engines); the RTT each cluster was built with."""
    _fake_topology(monkeypatch, {"basic": [300, 330, 310, 320, 340, 360], "dualpath": [200, 180, 220, 230, 250, 260]})
    built = []
    fake_cluster = compare.EmulatedCluster
    monkeypatch.setattr(compare, "EmulatedCluster", lambda config, *a, **k: built.append(config.store_rtt_ms)
                        or fake_cluster(config, *a, **k))  # fmt: skip
    config = BenchConfig(modes=("basic", "dualpath"), repeats=2, store_rtts_ms=(0.0, 5.0, 20.0)).validate()
    monkeypatch.setattr(compare, "summarize", lambda agents: {"agents": 16, "turns": 8.0, "append": 10.0,
                                                              "gen": 5.0, "context": 100.0, "hit_ratio": 0.9})  # fmt: skip
    return compare.run_comparison([], config, tmp_path, tmp_path), built


def test_each_store_rtt_gets_a_cluster_of_its_own_and_its_own_comparison(monkeypatch, tmp_path):
    payload, built = _rtt_payload(monkeypatch, tmp_path)
    assert built == [0.0, 5.0, 20.0]
    topologies = payload["topologies"]
    assert [(t["topology"], t["store_rtt_ms"], t["cluster"]["store_rtt_ms"]) for t in topologies] == [
        ("1P1D", 0.0, 0.0), ("1P1D", 5.0, 5.0), ("1P1D", 20.0, 20.0)]  # fmt: skip
    assert list(payload["config"]["store_rtts_ms"]) == [0.0, 5.0, 20.0]
    # Repetitions stay within their RTT's cluster: 300/200 and 330/180 at 0 ms, 310/220 and 320/230 at 5 ms.
    assert topologies[0]["comparison"]["dualpath_speedup"] == pytest.approx((1.5 + 330 / 180) / 2)
    assert topologies[1]["comparison"]["dualpath_speedup"] == pytest.approx((310 / 220 + 320 / 230) / 2)


def test_the_report_gives_every_row_its_store_rtt(monkeypatch, tmp_path):
    payload, _ = _rtt_payload(monkeypatch, tmp_path)
    topology = payload["topologies"][1]
    topology["runs"]["dualpath"]["relay"] = {"requests": {"GET": 120, "HEAD": 40, "PUT": 64}, "cpu_s": 3.25}
    text = report.markdown(payload)
    assert "| topology | store RTT ms | mode | JCT s |" in text
    assert "|---|--:|---|--:|" in text
    assert "| 1P1D | 0 | basic | 315.0 [300.0-330.0] | 1.00x |" in text
    assert "| 1P1D | 20 | dualpath | 255.0 [250.0-260.0] |" in text
    assert "- 1P1D at 5 ms store RTT: DualPath speedup" in text
    assert "- 1P1D at 5 ms store RTT dualpath: store requests through the relay: GET 120, HEAD 40, PUT 64; its CPU 3.2 s." in text
    assert "waited this long in a relay in the S3 namespace" in text
    assert report.plot(payload, tmp_path / "rtt.png") is not None
    # The control: without store RTTs the table keeps its columns (the committed results render as before).
    for entry in payload["topologies"]:
        del entry["store_rtt_ms"]
    payload["config"]["store_rtts_ms"] = []
    plain = report.markdown(payload)
    assert "store RTT" not in plain and "| 1P1D | basic | 315.0 [300.0-330.0] | 1.00x |" in plain
