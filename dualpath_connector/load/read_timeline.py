"""Per-read timestamps of an engine's store reads, as JSON lines (``read_timeline_dir``).

Which link is busy when is what the storage-NIC counters show; why a link
idles while reads wait needs each read's own times: when it queued, when its
lane started it, when it finished, and for whom (this engine's request, or a
PE's, read on this DE). ``dualpath-bench`` merges the files of all engines
(wall-clock times; the engines of one run share a clock) into per-link
timelines. Off by default: one line per read, written under a lock.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class ReadSpan:
    """One read: queued when made; :meth:`started` and :meth:`finished` stamp the rest (no timeline: nothing)."""

    def __init__(self, timeline: ReadTimeline | None, kind: str, tokens: int) -> None:
        self._timeline = timeline
        self._fields = {"kind": kind, "tokens": tokens, "queued": time.time()}

    def started(self) -> None:
        self._fields["started"] = time.time()

    def finished(self, outcome: str, chunks: int = 0) -> None:
        """``outcome``: "read" (``chunks`` readable), "declined" (a DE turned a PE's read down), "failed"."""
        if self._timeline is not None:
            now = time.time()
            self._timeline.write({**self._fields, "started": self._fields.get("started", now), "finished": now,
                                  "outcome": outcome, "chunks": chunks})  # fmt: skip


class ReadTimeline:
    """Appends one JSON line per finished read to ``<directory>/reads-<pid>.jsonl``, each naming ``engine``."""

    def __init__(self, directory: str, engine: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"reads-{os.getpid()}.jsonl"
        self.engine = engine
        self._lock = threading.Lock()
        self._file = self.path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        line = json.dumps({"engine": self.engine, **record})
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def load(directory: Path, since: float = 0.0, until: float = float("inf")) -> list[dict]:
    """Every record under ``directory`` whose read was queued in [since, until], by queue time."""
    records = []
    for path in sorted(directory.glob("reads-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed engine
            if since <= record.get("queued", -1.0) <= until:
                records.append(record)
    return sorted(records, key=lambda r: r["queued"])
