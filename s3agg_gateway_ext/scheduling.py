"""Bandwidth scheduling of concurrent layerwise requests under a total cap (ObjectCache §3.6, Table A4).

Each request declares its per-layer bytes ``s_i`` and per-layer compute window
``c_i``; its zero-stall rate is ``r*_i = s_i / c_i``. Allocation policies:

- ``equal``: ``B / n``.
- ``kv_prop``: proportional to the bytes retrieved.
- ``bw_prop``: proportional to ``r*_i``.
- ``stall_opt``: the minimiser of total stall ``sum(s_i / r_i - c_i)`` subject to
  ``sum r_i = B, 0 < r_i <= r*_i``. Its KKT conditions give
  ``r_i = min(r*_i, lam * sqrt(s_i))`` with ``lam`` set so the rates sum to ``B``
  (water-filling on ``sqrt(s_i)``); when ``sum r*_i <= B`` everyone gets ``r*_i``.
- ``calibrated_stall_opt``: the same with targets ``r*_i + delta``.

Rates are fixed per epoch: requests arriving during an epoch are admitted at
the next boundary and share only the bandwidth in-flight requests do not hold;
a finished request's bandwidth returns to the pool at the next boundary, never
to requests already running. Layer deliveries are paced by weighted deficit
round robin over quanta, each request at its own rate.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_ADMIT_FRACTION = 0.5


@dataclass(frozen=True)
class Demand:
    """One layerwise request as the scheduler sees it."""

    layer_bytes: float  # s_i: bytes delivered per layer
    compute_window_s: float  # c_i: compute time per layer the transfer can hide behind
    total_bytes: float  # bytes retrieved in all (for kv_prop)

    @property
    def zero_stall_rate(self) -> float:
        return self.layer_bytes / self.compute_window_s


def _water_fill(weights: Sequence[float], caps: Sequence[float], budget: float) -> list[float]:
    """``r_i = min(cap_i, lam * w_i)`` with ``sum r_i = budget`` (or everyone at cap if that fits)."""
    if sum(caps) <= budget:
        return list(caps)
    # Raise lam through the breakpoints cap_i / w_i in order; requests whose
    # breakpoint is passed are pinned at their cap.
    order = sorted(range(len(caps)), key=lambda i: caps[i] / weights[i])
    pinned: set[int] = set()
    free_weight = sum(weights)
    remaining = budget
    for i in order:
        if remaining / free_weight * weights[i] < caps[i]:
            break
        pinned.add(i)
        remaining -= caps[i]
        free_weight -= weights[i]
    lam = remaining / free_weight
    return [caps[i] if i in pinned else lam * weights[i] for i in range(len(caps))]


def _proportional(weights: Sequence[float], budget: float) -> list[float]:
    total = sum(weights)
    return [budget * w / total for w in weights]


def allocate(policy: str, demands: Sequence[Demand], budget: float, margin: float = 0.0) -> list[float]:
    """Per-request rates (bytes/s, or any unit used consistently) for one epoch."""
    if not demands:
        return []
    if policy == "equal":
        return [budget / len(demands)] * len(demands)
    if policy == "kv_prop":
        return _proportional([d.total_bytes for d in demands], budget)
    if policy == "bw_prop":
        return _proportional([d.zero_stall_rate for d in demands], budget)
    if policy in ("stall_opt", "calibrated_stall_opt"):
        shift = margin if policy == "calibrated_stall_opt" else 0.0
        return _water_fill([math.sqrt(d.layer_bytes) for d in demands],
                           [d.zero_stall_rate + shift for d in demands], budget)
    raise ValueError(f"unknown policy {policy!r}")


@dataclass
class Flow:
    """A request's lane on the link: its epoch rate and its pending layer sends."""

    demand: Demand
    rate: float = 0.0
    admitted: threading.Event = field(default_factory=threading.Event)
    deficit: float = 0.0
    next_time: float = 0.0
    # Set when the scheduler failed under this flow: its sends go at once, unpaced.
    unpaced: bool = False
    # [bytes still to send, event set when all sent]
    pending: collections.deque = field(default_factory=collections.deque)


class LinkScheduler:
    """Epoch admission, per-epoch allocation and WDRR pacing for one shared link of ``cap`` bytes/s."""

    def __init__(self, policy: str, cap: float, margin: float, epoch_s: float, quantum: int) -> None:
        self.policy = policy
        self.cap = cap
        self.margin = margin
        self.epoch_s = epoch_s
        self.quantum = quantum
        self._cond = threading.Condition()
        self._waiting: list[Flow] = []
        self._active: list[Flow] = []
        self._rr = 0
        # (time, event): sends whose last quantum is on the link until that time.
        self._finishing: list[tuple[float, threading.Event]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="s3agg-link", daemon=True)
        self._thread.start()

    def admit(self, demand: Demand, timeout_s: float) -> Flow:
        """Join the next epoch; returns once the flow holds a rate."""
        flow = Flow(demand)
        with self._cond:
            self._waiting.append(flow)
            self._cond.notify_all()
        if not flow.admitted.wait(timeout_s):
            self.leave(flow)
            raise TimeoutError(f"not admitted to a scheduling epoch within {timeout_s:.1f}s")
        return flow

    def leave(self, flow: Flow) -> None:
        with self._cond:
            if flow in self._waiting:
                self._waiting.remove(flow)
            if flow in self._active:
                self._active.remove(flow)
            for entry in flow.pending:
                entry[1].set()  # nobody waits on a departed flow's sends
            flow.pending.clear()
            self._cond.notify_all()

    def send(self, flow: Flow, nbytes: int, timeout_s: float) -> None:
        """Block until ``nbytes`` of this flow have passed the link at its rate."""
        done = threading.Event()
        with self._cond:
            if flow.unpaced:
                return
            flow.pending.append([float(nbytes), done])
            self._cond.notify_all()
        if not done.wait(timeout_s):
            raise TimeoutError(f"layer send of {nbytes} bytes not paced within {timeout_s:.1f}s")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _start_epoch(self, now: float) -> None:
        free = self.cap - sum(f.rate for f in self._active)
        # A batch waits for running flows to return bandwidth rather than start on a
        # trickle: it needs at least half of its head-count share of the cap.
        share = self.cap * len(self._waiting) / (len(self._active) + len(self._waiting) or 1)
        if not self._waiting or free < _ADMIT_FRACTION * share:
            return
        # Allocated before the batch leaves the waiting list: a failure here still finds its flows.
        rates = allocate(self.policy, [f.demand for f in self._waiting], free, self.margin)
        batch, self._waiting = self._waiting, []
        for flow, rate in zip(batch, rates):
            flow.rate = rate
            flow.next_time = now
            self._active.append(flow)
            flow.admitted.set()
        logger.info("epoch: admitted %d flows, rates %s B/s (policy %s, free %.0f of %.0f)",
                    len(batch), [round(f.rate) for f in batch], self.policy, free, self.cap)

    def _run(self) -> None:
        # Pacing shares the link; it must never be what stops a transfer. A failure here (a bug, an input no
        # check foresaw) releases every flow unpaced and scheduling starts over, instead of ending the thread
        # and leaving each request to run into its timeout.
        while True:
            try:
                self._schedule()
                return
            except Exception:
                logger.exception("link scheduler failed; its flows go on unpaced and scheduling starts over")
                with self._cond:
                    self._release_unpaced()

    def _release_unpaced(self) -> None:
        for flow in (*self._waiting, *self._active):
            flow.unpaced = True
            flow.rate = flow.rate or self.cap
            flow.admitted.set()
            for entry in flow.pending:
                entry[1].set()
            flow.pending.clear()
        for _, event in self._finishing:
            event.set()
        self._waiting, self._active, self._finishing = [], [], []

    def _schedule(self) -> None:
        # Epochs tick while the link is busy; the first arrival at an idle link
        # opens a batch window of one epoch, so requests arriving together share it.
        next_epoch: float | None = None
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                if next_epoch is None and self._waiting:
                    next_epoch = now + self.epoch_s
                if next_epoch is not None and now >= next_epoch:
                    self._start_epoch(now)
                    next_epoch = now + self.epoch_s if self._active or self._waiting else None
                for item in [f for f in self._finishing if f[0] <= now]:
                    self._finishing.remove(item)
                    item[1].set()
                wake = min([next_epoch or math.inf] + [f[0] for f in self._finishing])
                backlog = [f for f in self._active if f.pending]
                if backlog:
                    wake = min(wake, self._dispatch(backlog, now))
                self._cond.wait(None if wake == math.inf else max(0.0, wake - time.monotonic()))

    def _dispatch(self, backlog: list[Flow], now: float) -> float:
        """One WDRR round over flows whose lane is free; returns when the next one frees."""
        top = max(f.rate for f in backlog)
        for k in range(len(backlog)):
            flow = backlog[(self._rr + k) % len(backlog)]
            if flow.next_time > now:
                continue
            # Quantum weighted by rate: faster flows send more per round.
            flow.deficit += self.quantum * flow.rate / top
            entry = flow.pending[0]
            piece = min(entry[0], flow.deficit)
            entry[0] -= piece
            flow.deficit -= piece
            flow.next_time = max(flow.next_time, now) + piece / flow.rate
            if entry[0] <= 0:
                flow.pending.popleft()
                # The layer has left the link once its last quantum's time has passed.
                self._finishing.append((flow.next_time, entry[1]))
                if not flow.pending:
                    flow.deficit = 0.0  # DRR: an emptied queue keeps no credit
        self._rr += 1
        return min(f.next_time for f in backlog)
