"""How the storage links were used while reads waited, from the engines' read timelines.

The storage-NIC counters say how busy each link was; they cannot say whether a
link idled while a read it could have served was waiting elsewhere. The
engines' read timelines (``read_timeline_dir``, one record per store read with
its queue, start and finish times, on the engine that read it) can: at each
instant, ``outstanding`` reads are queued or running somewhere and ``busy``
links are reading. A link that idles while another link's reads queue is the
"taking turns" pattern; ``use_while_waiting`` is the mean of busy links over
the links the outstanding reads could keep busy (1.0: none idled).
"""

from __future__ import annotations

import statistics


def link_use(records: list[dict], engine_nodes: dict[str, str], t0: float, t1: float, step_s: float = 0.25,
             link_tokens_per_s: float | None = None) -> dict:
    """Per-instant outstanding reads and busy links over [t0, t1]; ``engine_nodes`` maps a record's engine to its node.

    Over the *read span* (the instants with any read outstanding): how often every link read at once, and, given
    each link's rate ``link_tokens_per_s``, the share of the links' combined rate the reads moved, the figure a
    DualPath run is held to (one outstanding read can keep one link busy: ``use_while_waiting`` calls that
    full use, this one does not).
    """
    nodes = sorted(set(engine_nodes.values()))
    reads = [r for r in records if r.get("outcome") != "declined" and r.get("engine") in engine_nodes]
    steps = max(0, int((t1 - t0) / step_s))
    times = [t0 + i * step_s for i in range(steps + 1)]
    outstanding = [sum(r["queued"] <= t < r["finished"] for r in reads) for t in times]
    busy = {
        node: [int(any(r["started"] <= t < r["finished"] for r in reads if engine_nodes[r["engine"]] == node)) for t in times]
        for node in nodes
    }
    shares = [
        sum(busy[node][i] for node in nodes) / min(waiting, len(nodes))
        for i, waiting in enumerate(outstanding)
        if waiting
    ]
    both = [all(busy[node][i] for node in nodes) for i, waiting in enumerate(outstanding) if waiting >= len(nodes)]
    spanned = [i for i, waiting in enumerate(outstanding) if waiting]
    span_s = len(spanned) * step_s
    all_busy = [all(busy[node][i] for node in nodes) for i in spanned]
    moved = sum(r["tokens"] for r in reads)
    combined = link_tokens_per_s * len(nodes) * span_s if link_tokens_per_s and span_s else None
    # Per link: what it moved over the read span, and over its own busy instants (below 1 there, the link read
    # slower than its rate while it read: CPU or per-request costs, not scheduling, held it back).
    node_tokens = {node: sum(r["tokens"] for r in reads if engine_nodes[r["engine"]] == node) for node in nodes}
    node_busy_s = {node: sum(busy[node]) * step_s for node in nodes}
    per_link = {
        node: {
            "busy_s": node_busy_s[node],
            "rate_over_read_span": node_tokens[node] / (link_tokens_per_s * span_s) if combined else None,
            "rate_while_busy": (node_tokens[node] / (link_tokens_per_s * node_busy_s[node])
                                if link_tokens_per_s and node_busy_s[node] else None),
        }
        for node in nodes
    }  # fmt: skip
    waits = {kind: [r["started"] - r["queued"] for r in reads if r.get("kind") == kind] for kind in ("own", "for_peer")}
    # What one read achieved on its link (the link's effective rate, below its nominal one).
    rates = {kind: [r["tokens"] / (r["finished"] - r["started"]) for r in reads
                    if r.get("kind") == kind and r["finished"] > r["started"]] for kind in ("own", "for_peer")}  # fmt: skip
    return {
        "reads": len(reads),
        "declined": sum(r.get("outcome") == "declined" for r in records if r.get("engine") in engine_nodes),
        "use_while_waiting": statistics.fmean(shares) if shares else None,
        "all_busy_while_enough_wait": statistics.fmean(both) if both else None,
        "read_span_s": span_s,
        "all_busy_over_read_span": statistics.fmean(all_busy) if all_busy else None,
        "one_link_alone_s": sum(sum(busy[node][i] for node in nodes) == 1 for i in spanned) * step_s,
        "combined_rate_fraction": moved / combined if combined else None,
        "per_link": per_link,
        "queue_wait_s_median": {kind: statistics.median(w) if w else None for kind, w in waits.items()},
        "read_tokens_per_s_median": {kind: statistics.median(r) if r else None for kind, r in rates.items()},
        "series": {"t": [t - t0 for t in times], "outstanding": outstanding, "busy": busy},
    }
