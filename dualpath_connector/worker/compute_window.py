"""The per-layer compute window of this engine's forwards, measured, for the store's bandwidth scheduler.

The s3agg gateway paces a layerwise delivery so each layer lands within the
time the forward spends on the layer before it (ObjectCache's Calibrated
Stall-opt). A descriptor declares that window; a fixed guess (the gateway's
10 ms default) is wrong for every model and batch but one, so the worker
measures it: in each forward that injects loads, the host time between
``wait_for_layer_load`` returning for layer ``l`` and being entered for layer
``l+1`` (the compute of layer ``l``), averaged over the forward's layers and
folded into an exponentially weighted moving average.

On a GPU the host only launches kernels, so these host times undercount the
device's; they are the launch-bound lower end of the window.
"""

from __future__ import annotations

import time

# Weight of the newest forward: a few forwards move the estimate, one outlier does not.
EWMA_ALPHA = 0.2


class ComputeWindow:
    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        self.alpha = alpha
        self._seconds: float | None = None
        self._left_at: float | None = None
        self._sum = 0.0
        self._count = 0

    @property
    def seconds(self) -> float | None:
        """The current estimate; None until one forward was measured."""
        return self._seconds

    def entered(self, layer: int) -> None:
        """The forward reached layer ``layer`` (before waiting for its load)."""
        now = time.perf_counter()
        if layer == 0:
            self._left_at, self._sum, self._count = None, 0.0, 0
        elif self._left_at is not None:
            self._sum += now - self._left_at
            self._count += 1

    def left(self, layer: int, last: bool) -> None:
        """Layer ``layer``'s load is in; its compute starts now. ``last``: the forward's last layer."""
        self._left_at = time.perf_counter()
        if last and self._count:
            sample = self._sum / self._count
            self._seconds = sample if self._seconds is None else self._seconds + self.alpha * (sample - self._seconds)
            self._left_at = None
