"""ReadTimeline: one JSON line per read with its queue, start and finish times, and the loader the bench uses."""

from __future__ import annotations

import json

from dualpath_connector.load.read_timeline import ReadSpan, ReadTimeline, load


def test_spans_write_one_ordered_record_each(tmp_path):
    timeline = ReadTimeline(str(tmp_path / "t"), "10.0.0.1:5700")
    own = ReadSpan(timeline, "own", 640)
    own.started()
    own.finished("read", 20)
    ReadSpan(timeline, "for_peer", 96).finished("declined")  # turned down before it started
    timeline.close()
    ReadSpan(timeline, "own", 1).finished("read", 1)  # after close: dropped, no error

    records = load(tmp_path / "t")
    assert [(r["engine"], r["kind"], r["tokens"], r["outcome"], r["chunks"]) for r in records] == [
        ("10.0.0.1:5700", "own", 640, "read", 20), ("10.0.0.1:5700", "for_peer", 96, "declined", 0)]  # fmt: skip
    for record in records:
        assert record["queued"] <= record["started"] <= record["finished"]


def test_load_keeps_a_window_and_skips_a_cut_line(tmp_path):
    lines = [{"engine": "a", "queued": t, "started": t, "finished": t + 1} for t in (10.0, 20.0, 30.0)]
    (tmp_path / "reads-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"engine": "a", "que')
    (tmp_path / "reads-2.jsonl").write_text(json.dumps({"engine": "b", "queued": 15.0}) + "\n")
    assert [(r["engine"], r["queued"]) for r in load(tmp_path, since=12.0, until=25.0)] == [("b", 15.0), ("a", 20.0)]
