"""Does layerwise loading pay? How long one forward waited for its loads, and how much of their time it hid.

Per forward with a layerwise injection:

- ``layer_wait_seconds``: the time the forward stood still in
  ``wait_for_layer_load``, summed over layers: host time on the CPU path and
  for READs from a DE, the compute stream's stall on the GPU (from CUDA events:
  a layer's bytes ready after the forward reached it);
- ``layer_load_seconds``: the time the loads took on their own: the device
  copies from first to last on the copy stream, the CPU path's copies, and
  for READs from a DE from their posting to the last layer seen in (an upper
  bound: a READ is only seen complete when the forward checks it);
- ``layer_load_hidden_fraction`` (gauge): ``1 - wait / load`` of the latest
  forward: 1 when every byte moved behind compute, 0 when none did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath_connector.cache.copy_stream import Mark
from dualpath_connector.metrics.stats_recorder import StatsRecorder


@dataclass
class StepLoadTiming:
    host_wait_s: float = 0.0
    host_load_s: float = 0.0
    # Device copies: (start, end) marks on the copy stream.
    device_loads: list[tuple[Mark, Mark]] = field(default_factory=list)
    # Per layer reached with device copies pending: (compute stream at that layer, the copies it waited for).
    device_waits: list[tuple[Mark, list[Mark]]] = field(default_factory=list)

    def all_marks(self) -> list[Mark]:
        return [m for pair in self.device_loads for m in pair] + [
            m for reached, ready in self.device_waits for m in (reached, *ready)
        ]

    def resolved(self) -> bool:
        """Every device mark was reached, so the figures can be read (never blocks)."""
        return all(mark.reached() for mark in self.all_marks())

    def report(self, stats: StatsRecorder) -> None:
        """Record the figures; only once :meth:`resolved`."""
        device_wait = sum(
            max(0.0, max(reached.seconds_until(mark) for mark in ready)) for reached, ready in self.device_waits
        )
        device_load = max((start.seconds_until(end) for start, end in self.device_loads), default=0.0)
        wait = self.host_wait_s + device_wait
        load = max(self.host_load_s, device_load)
        stats.sample("layer_wait_seconds", wait)
        stats.sample("layer_load_seconds", load)
        if load > 0:
            stats.gauge(layer_load_hidden_fraction=round(max(0.0, 1.0 - wait / load), 4))
