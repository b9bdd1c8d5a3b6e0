"""bench_read_sides counts a sample only where its mode's engine read the hit: a DE that declined (the PE read it
after all) must not pass as a DE-side read in the medians."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_read_sides  # noqa: E402


def _sample(side: str, jct_s: float, on_its_side: bool) -> dict:
    return {"side": side, "jct_s": jct_s, "on_its_side": on_its_side, "load_s": jct_s / 2, "loads": 1,
            "pull_s": 0.01, "hit_tokens": 2976}  # fmt: skip


def test_samples_read_on_the_other_side_stay_out_of_the_medians():
    samples = [_sample("pe", 1.0, True), _sample("de", 1.5, True), _sample("de", 9.0, False), _sample("pe", 3.0, True)]
    row = bench_read_sides.summarize(None, 3000, samples)
    assert row["de"]["on_its_side"] == "1/2" and row["de"]["jct_ms_median"] == 1500
    assert row["pe"]["on_its_side"] == "2/2" and row["pe"]["jct_ms_median"] == 2000
    assert row["de_over_pe"] == 0.75
    payload = {"config": {"reps": 2, "store_rtt_ms": []}, "results": [row],
               "environment": {"cpu_count": 2, "load_avg_at_start": [1.0], "load_avg_at_end": [2.0]}}  # fmt: skip
    last = bench_read_sides.table(payload).splitlines()[-1]
    assert [cell.strip() for cell in last.strip("|").split("|")][:5] == ["3000", "2976", "2000 [1000-3000]",
                                                                      "1500 [1500-1500]", "0.75x"]
