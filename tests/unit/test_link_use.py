"""link_use: whether the storage links were busy together while reads waited, from per-read timelines."""

from __future__ import annotations

import pytest

from dualpath_bench.link_use import link_use

NODES = {"pe:1": "pe0", "de:1": "de0"}


def _read(engine: str, queued: float, started: float, finished: float, kind: str = "own", outcome: str = "read") -> dict:
    return {"engine": engine, "kind": kind, "queued": queued, "started": started, "finished": finished,
            "outcome": outcome, "tokens": 64, "chunks": 1}  # fmt: skip


def test_two_links_reading_side_by_side_are_fully_used():
    reads = [_read("pe:1", 0.0, 0.0, 4.0), _read("de:1", 0.0, 0.0, 4.0, "for_peer"),
             _read("pe:1", 0.0, 4.0, 8.0), _read("de:1", 0.0, 4.0, 8.0, "for_peer")]  # fmt: skip
    use = link_use(reads, NODES, 0.0, 8.0, step_s=0.5, link_tokens_per_s=16.0)
    assert use["use_while_waiting"] == pytest.approx(1.0)
    assert use["all_busy_while_enough_wait"] == pytest.approx(1.0)
    # 256 tokens over an 8 s read span of two 16 tokens/s links: all of their combined rate.
    assert (use["read_span_s"], use["one_link_alone_s"]) == (8.0, 0.0)
    assert use["combined_rate_fraction"] == pytest.approx(1.0) and use["all_busy_over_read_span"] == pytest.approx(1.0)
    assert use["queue_wait_s_median"] == {"own": pytest.approx(2.0), "for_peer": pytest.approx(2.0)}
    assert use["read_tokens_per_s_median"] == {"own": pytest.approx(16.0), "for_peer": pytest.approx(16.0)}  # 64 in 4 s
    # Each link read all of the span at its full rate.
    assert use["per_link"]["de0"] == {"busy_s": 8.0, "rate_over_read_span": pytest.approx(1.0),
                                      "rate_while_busy": pytest.approx(1.0)}  # fmt: skip


def test_links_taking_turns_while_reads_wait_score_half():
    """Negative control: the same four reads, but one link at a time while the others wait."""
    reads = [_read("pe:1", 0.0, 0.0, 2.0), _read("de:1", 0.0, 2.0, 4.0, "for_peer"),
             _read("pe:1", 0.0, 4.0, 6.0), _read("de:1", 0.0, 6.0, 8.0, "for_peer")]  # fmt: skip
    use = link_use(reads, NODES, 0.0, 8.0, step_s=0.5, link_tokens_per_s=32.0)
    # Each link at 32 tokens/s read 64 in 2 s: the two links together moved half their combined rate.
    assert use["combined_rate_fraction"] == pytest.approx(0.5) and use["all_busy_over_read_span"] == pytest.approx(0.0)
    assert use["one_link_alone_s"] == 8.0
    # Each link moved half of what it could over the span at its full rate while it read: it idled half the span.
    assert use["per_link"]["pe0"] == {"busy_s": 4.0, "rate_over_read_span": pytest.approx(0.5),
                                      "rate_while_busy": pytest.approx(1.0)}  # fmt: skip
    # While two or more reads were outstanding (0-6 s) one link of two read; the last read alone (6-8 s) had its link.
    assert use["all_busy_while_enough_wait"] == pytest.approx(0.0)
    assert use["use_while_waiting"] == pytest.approx((12 * 0.5 + 4 * 1.0) / 16)


def test_declined_reads_and_unknown_engines_are_not_reads():
    reads = [_read("de:1", 0.0, 0.0, 0.0, "for_peer", "declined"), _read("other:9", 0.0, 0.0, 5.0),
             _read("pe:1", 1.0, 1.0, 2.0)]  # fmt: skip
    use = link_use(reads, NODES, 0.0, 3.0, step_s=0.5)
    assert (use["reads"], use["declined"]) == (1, 1)
    # One read outstanding at a time and its link busy: nothing idled that could have read.
    assert use["use_while_waiting"] == pytest.approx(1.0)
    assert use["series"]["busy"]["de0"] == [0] * len(use["series"]["t"])


def test_no_reads_no_figure():
    use = link_use([], NODES, 0.0, 1.0, link_tokens_per_s=10.0)
    assert use["use_while_waiting"] is None and use["all_busy_while_enough_wait"] is None
    assert use["combined_rate_fraction"] is None and use["read_span_s"] == 0.0


def test_a_link_busy_all_along_at_half_its_rate_is_slow_not_idle():
    """The per-link figures tell an under-delivering link (CPU, per-request costs) from an idle one."""
    reads = [_read("pe:1", 0.0, 0.0, 4.0), _read("de:1", 0.0, 0.0, 4.0, "for_peer"),
             _read("pe:1", 0.0, 4.0, 8.0), _read("de:1", 0.0, 4.0, 8.0, "for_peer")]  # fmt: skip
    use = link_use(reads, NODES, 0.0, 8.0, step_s=0.5, link_tokens_per_s=32.0)
    assert use["all_busy_over_read_span"] == pytest.approx(1.0) and use["combined_rate_fraction"] == pytest.approx(0.5)
    for node in ("pe0", "de0"):
        assert use["per_link"][node]["rate_while_busy"] == pytest.approx(0.5)
