"""Where the connector's host<->device copies run: their own stream, ordered against the forward's by events.

One narrow interface, two implementations:

- :class:`CudaCopyStream`: a CUDA stream beside the forward's (the *compute*
  stream), and a second one for the device-side work of a load (the scatter
  from staging into KV blocks), so the DMA engine moves layer ``l+1`` while
  layer ``l``'s scatter waits for SMs the forward's kernels hold. The copy stream first waits for what the compute stream has queued
  (a block handed to a new request may still be read by the last forward);
  the compute stream waits for a copy's event right before it needs the bytes.
  Neither wait blocks the host. Copies are ``tensor.copy_(non_blocking=True)``
  between pinned host memory and the device, i.e. ``cudaMemcpyAsync`` on this
  stream, which ``mma_preload`` splits across PCIe paths when it is preloaded.
- :class:`InlineCopyStream`: every operation runs at once on the calling thread
  and every mark is already reached. It stands in for a stream where there is
  none (CPU tensors), so the device copy plans run, and are tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch


class Mark(ABC):
    """A point in a stream's work: reached once everything queued before it has run."""

    @abstractmethod
    def reached(self) -> bool:
        """Whether the stream got here (never blocks)."""

    @abstractmethod
    def wait(self) -> None:
        """Block the calling thread until the stream gets here."""

    @abstractmethod
    def seconds_until(self, later: Mark) -> float:
        """Time from this mark to ``later`` (both reached); negative if ``later`` came first."""


class CopyStream(ABC):
    @abstractmethod
    def follow_compute(self) -> None:
        """Work queued on this stream from now on runs after what the compute stream has queued so far."""

    @abstractmethod
    def active(self) -> contextlib.AbstractContextManager:
        """Tensor operations issued inside run on this stream."""

    @abstractmethod
    def mark(self) -> Mark:
        """A mark after the work queued on this stream so far."""

    @abstractmethod
    def scatter_active(self) -> contextlib.AbstractContextManager:
        """Tensor operations issued inside run on the scatter stream (a load's device-side kernels)."""

    @abstractmethod
    def scatter_mark(self) -> Mark:
        """A mark after the work queued on the scatter stream so far."""

    @abstractmethod
    def waits(self, mark: Mark) -> None:
        """Work queued on this stream from now on runs after ``mark`` (a scatter-stream mark)."""

    @abstractmethod
    def scatter_waits(self, mark: Mark) -> None:
        """Work queued on the scatter stream from now on runs after ``mark`` (a copy-stream mark)."""

    @abstractmethod
    def keep_for_scatter(self, tensor: torch.Tensor) -> None:
        """``tensor`` (made on this stream) stays allocated until the scatter stream's queued work has run."""

    @abstractmethod
    def compute_mark(self) -> Mark:
        """A mark after the work queued on the compute stream so far."""

    @abstractmethod
    def compute_waits(self, mark: Mark) -> None:
        """Work queued on the compute stream from now on runs after ``mark`` (the host does not wait)."""


class _InlineMark(Mark):
    def __init__(self) -> None:
        self.at = time.perf_counter()

    def reached(self) -> bool:
        return True

    def wait(self) -> None:
        return

    def seconds_until(self, later: Mark) -> float:
        assert isinstance(later, _InlineMark)
        return later.at - self.at


class InlineCopyStream(CopyStream):
    def follow_compute(self) -> None:
        return

    def active(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def mark(self) -> Mark:
        return _InlineMark()

    def scatter_active(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def scatter_mark(self) -> Mark:
        return _InlineMark()

    def waits(self, mark: Mark) -> None:
        return

    def scatter_waits(self, mark: Mark) -> None:
        return

    def keep_for_scatter(self, tensor: torch.Tensor) -> None:
        return

    def compute_mark(self) -> Mark:
        return _InlineMark()

    def compute_waits(self, mark: Mark) -> None:
        return


class _CudaMark(Mark):
    def __init__(self, stream: torch.cuda.Stream) -> None:
        # Timing events cost a little more to record; they let the stall metric
        # be read from the GPU's own clock instead of a host synchronisation.
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)

    def reached(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def seconds_until(self, later: Mark) -> float:
        assert isinstance(later, _CudaMark)
        return self.event.elapsed_time(later.event) / 1000.0


class CudaCopyStream(CopyStream):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.scatter_stream = torch.cuda.Stream(device=device)
        # Threads other than the forward's (bulk loads run on the read lane)
        # order against the stream the forward ran on when this was built.
        self._default_compute = torch.cuda.current_stream(device)

    def _compute(self) -> torch.cuda.Stream:
        current = torch.cuda.current_stream(self.device)
        # The read lane's current stream is the device's default one, which the forward need not use.
        return current if current != torch.cuda.default_stream(self.device) else self._default_compute

    def follow_compute(self) -> None:
        self.stream.wait_stream(self._compute())

    def active(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def mark(self) -> Mark:
        return _CudaMark(self.stream)

    def scatter_active(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.scatter_stream)

    def scatter_mark(self) -> Mark:
        return _CudaMark(self.scatter_stream)

    def waits(self, mark: Mark) -> None:
        assert isinstance(mark, _CudaMark)
        self.stream.wait_event(mark.event)

    def scatter_waits(self, mark: Mark) -> None:
        assert isinstance(mark, _CudaMark)
        self.scatter_stream.wait_event(mark.event)

    def keep_for_scatter(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.scatter_stream)

    def compute_mark(self) -> Mark:
        return _CudaMark(self._compute())

    def compute_waits(self, mark: Mark) -> None:
        assert isinstance(mark, _CudaMark)
        self._compute().wait_event(mark.event)


def copy_stream_for(device: torch.device) -> CopyStream:
    """The stream copies to and from a cache on ``device`` run on."""
    return CudaCopyStream(device) if device.type == "cuda" else InlineCopyStream()


@contextlib.contextmanager
def pinned(array_addr: int, nbytes: int, device: torch.device) -> Iterator[None]:
    """Page-lock a host region with the CUDA runtime for as long as the context lasts (no-op off CUDA).

    Pinned memory is what makes an H2D/D2H copy asynchronous (a pageable
    source is staged through a driver buffer, synchronously). Done once per
    pool at start-up: registering costs milliseconds per GiB.
    """
    if device.type != "cuda":
        yield
        return
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(array_addr, nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(status)}")
    try:
        yield
    finally:
        cudart.cudaHostUnregister(array_addr)
