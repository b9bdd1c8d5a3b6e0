"""Layer arrival: a hit whose layers land in the pool one at a time, used while the rest are still coming.

With a store that delivers per layer (``KVStore.delivers_layers``: the s3agg
gateway), a ``layerwise`` load is reported as soon as layer 0 of its hit has
landed and verified; the forward that then runs it waits in
``wait_for_layer_load(l)`` for layer ``l`` alone, so the storage transfer of
layer ``l+1`` overlaps the compute of layer ``l`` (ObjectCache's point).

:class:`LayerArrivals` is the meeting point of the read lane (which lands
layers as they are verified) and the forward (which waits for them). Each
landed layer says how many leading chunks verified. A layer that does not land
in time, or lands with fewer good chunks than were reported, fails those
chunks' blocks: the worker reports them to vLLM as load errors after the
forward, and vLLM recomputes them (``kv_load_failure_policy: recompute``);
their bytes never reach attention as if they were right.

The pool slots of an arriving hit return to the pool only when both sides are
done with them: the read has ended (the gateway writes nothing more) and the
forward (or the request's end) released them (:meth:`LayerArrivals.when_ended`).
A read abandoned at its deadline has ended for the forward, not for the slots:
NIXL may still write them, so they wait until its transfers ended
(:meth:`LayerArrivals.transfers_ended`, from the reaper), or for ever where
nothing can tell (a gateway's WRITEs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LayerArrivals:
    """Which layers of one hit have landed, and how many leading chunks of each verified."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._good: list[int] = []  # per landed layer, in order
        self._landed_at: list[float] = []
        self._ended = False
        self._abandoned = False
        self._error: str | None = None
        self._on_end: list[Callable[[], None]] = []

    # -- the read lane ------------------------------------------------------------------

    def land(self, layer: int, good_chunks: int) -> None:
        """Layer ``layer`` is in place; its first ``good_chunks`` chunks verified. Layers land in order."""
        with self._cond:
            if layer != len(self._good):
                raise RuntimeError(f"layer {layer} landed after {len(self._good)} layers")
            self._good.append(good_chunks)
            self._landed_at.append(time.perf_counter())
            self._cond.notify_all()

    def end(self, error: str | None = None, *, abandoned: bool = False) -> None:
        """The read ended: no more layers will land. Unless ``abandoned`` (NIXL may still write the slots: the
        :meth:`when_ended` callbacks wait for :meth:`transfers_ended`), the store writes nothing more and they
        run."""
        with self._cond:
            if self._ended:
                return  # the first end says what happened to the slots
            self._ended = True
            self._error = error
            self._abandoned = abandoned
            self._cond.notify_all()
        if not abandoned:
            self._run_on_end()

    def transfers_ended(self) -> None:
        """An abandoned read's transfers have all ended: nothing writes the slots any more."""
        with self._cond:
            self._abandoned = False
        self._run_on_end()

    def _run_on_end(self) -> None:
        with self._cond:
            callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            callback()

    # -- the forward ----------------------------------------------------------------------

    def wait(self, layer: int, timeout_s: float) -> int:
        """Leading chunks of ``layer`` that verified, waiting up to ``timeout_s`` for it to land; 0 if it did
        not land in time or never will (the read failed)."""
        with self._cond:
            landed = self._cond.wait_for(lambda: len(self._good) > layer or self._ended, timeout_s)
            if len(self._good) > layer:
                return self._good[layer]
        if not landed:
            logger.warning("layer %d did not land within %.1fs", layer, timeout_s)
        elif self._error is not None:
            logger.warning("layer %d will not land: %s", layer, self._error)
        return 0

    def complete(self, chunks: int) -> bool:
        """Every layer landed with at least ``chunks`` good chunks: nothing is left to wait for."""
        with self._cond:
            return len(self._good) == self.num_layers and min(self._good) >= chunks

    def last_landed_at(self) -> float | None:
        with self._cond:
            return self._landed_at[-1] if self._landed_at else None

    def when_ended(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the read has ended (an abandoned one: once its transfers ended): now if it has,
        else on the thread that ends it."""
        with self._cond:
            if not self._ended or self._abandoned:
                self._on_end.append(callback)
                return
        callback()
