"""The aggregation engine: validated descriptor -> ranged reads -> assembled layers -> delivery.

Per bucket the gateway holds one NIXL agent (its :mod:`~s3agg_gateway_ext.backing`)
with two backends: the backing's read backend (OBJ: ranged GETs from an S3
store; POSIX: reads of the store root's files), moving object ranges into a
registered staging buffer, and UCX (WRITEs into the client's registered
buffer, each carrying a per-layer "ready" notification).

Every stored object is the chunk's Full Block followed by its integrity
trailer (one digest per layer, :mod:`nixl_backends.integrity`); every delivery
carries the digests of the layers it delivers, so the reader can verify each
layer as it arrives. The gateway moves digests, it never checks them.

Layerwise mode reads windows of ``k`` consecutive layers of every chunk, ``k`` the
fewest layers of at least ``min_read_bytes`` (a GET to an S3 store costs milliseconds
whatever its size, so windows are sized in bytes); with ``k = 1`` each read lands
at its assembled offset (chunk ``j`` of the layer at ``j*S``), so a layer is
contiguous without any copy. The trailers are read once, one ranged GET per
chunk alongside window 0's reads: layer 0 needs its digests, and the trailer
sits after the last layer, so it is contiguous with a layer window only when
one window covers every layer: then each object is one GET (layers and trailer)
and its layers leave one by one once all objects are in. No size is asked of
the store (no HEAD): the descriptor's layout gives them, and staged trailers are
zeroed before a whole-object read, so a short object reaches its reader with
zero digests, a failed chunk there. Each window's digests are then placed right
after its layers in staging (a copy of ``D`` bytes per chunk and layer), so a
layer and its digests leave as one contiguous delivery. Two staging windows
alternate: window ``w+1`` is read while window ``w``'s layers are delivered.
Staging is bounded per request and in total (:mod:`~s3agg_gateway_ext.staging`):
``k`` is lowered until a request's staging fits, and what abandoned transfers
staged is freed once NIXL is done with it.
Chunkwise mode reads whole objects, trailer included (one GET per chunk), and
delivers them at once, in chunk order.

Nothing here copies Layer Block bytes in Python: reads land through NIXL,
layers leave through NIXL (descriptor lists built with numpy, adjacent slices
merged) or as memoryviews the HTTP server writes out.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from botocore.exceptions import BotoCoreError, ClientError

from nixl_backends.abandoned import AbandonedTransfers
from nixl_backends.nixl_io import TransferAbandoned, coalesce, descriptors, run_nixl_transfers, wait_until
from nixl_backends.s3agg_protocol import MODE_CHUNKWISE, MODE_LAYERWISE, Mode, encode_notification
from s3agg_gateway_ext.backing import Backing, make_backing
from s3agg_gateway_ext.config import GatewayConfig
from s3agg_gateway_ext.descriptor import Descriptor, DescriptorError, NixlTarget
from s3agg_gateway_ext.scheduling import Demand, Flow, LinkScheduler
from s3agg_gateway_ext.staging import StagingBudget, StagingPlan, staging_plan

logger = logging.getLogger(__name__)

class StorageError(RuntimeError):
    """The store failed a read the descriptor validation had allowed (HTTP 502)."""


class DeliveryError(RuntimeError):
    """A NIXL WRITE into the client's buffer failed (HTTP 502)."""


class RequestCanceled(RuntimeError):
    """The client canceled the request (``s3agg_protocol.CANCEL_QUERY``): no further WRITE is started (HTTP 409)."""


@dataclass
class Unit:
    """One delivery: a layer of every chunk with its digests, or (chunkwise) every stored object."""

    kind: Literal["layer", "chunks"]
    index: int
    # The payload in staging, in delivery order (an HTTP frame is their concatenation): a layer's
    # (N, S) Layer Blocks (strided when k > 1) and their (N, D) digests, or the (N, L*(S+D)) objects.
    parts: list[np.ndarray]
    # Staging address of every (chunk[, layer]) Layer Block and of its digest, and their layers.
    local: np.ndarray
    digest_local: np.ndarray
    layers: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


@dataclass
class Job:
    """One accepted request, from validation to its last delivery."""

    request_id: str
    desc: Descriptor
    mode: Mode
    io: Backing
    remote_agent: str | None
    flow: Flow | None
    # How the request is staged (window size, bytes), from its descriptor.
    plan: StagingPlan | None = None
    timings: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    # NIXL handles of transfers that outlived their deadline: staging is then freed only once they ended.
    abandoned_handles: list = field(default_factory=list, repr=False)
    # What a cancel needs to know, guarded by _writes: once canceled no WRITE into the client's buffer starts;
    # write_in_flight: one is posted and has not ended; write_abandoned: one outlived io_timeout_s, it may land
    # at any time (a storage read abandoned sets only ``abandoned``: it endangers staging, not the client) until
    # abandoned_ended: every abandoned transfer of the job ended (the staging reaper saw their handles end).
    canceled: bool = False
    write_in_flight: bool = False
    write_abandoned: bool = False
    abandoned_ended: bool = False
    _writes: threading.Condition = field(default_factory=threading.Condition, repr=False)

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """Around one WRITE into the client's buffer: refused once the request is canceled."""
        with self._writes:
            if self.canceled:
                raise RequestCanceled(f"request {self.request_id} was canceled by its client")
            self.write_in_flight = True
        try:
            yield
        except TransferAbandoned:
            self.write_abandoned = True
            raise
        finally:
            with self._writes:
                self.write_in_flight = False
                self._writes.notify_all()

    def cancel(self, timeout_s: float) -> bool:
        """Start no WRITE any more; True once none is in flight (within ``timeout_s``) and none that was abandoned
        can still land."""
        with self._writes:
            self.canceled = True
            self._writes.wait_for(lambda: not self.write_in_flight, timeout_s)
            return not (self.write_in_flight or self.writes_may_land)

    @property
    def writes_may_land(self) -> bool:
        """A WRITE of the job was abandoned and has not ended."""
        return self.write_abandoned and not self.abandoned_ended

    def transfers_ended(self) -> None:
        """Every transfer the job abandoned has ended: none of its WRITEs can land any more."""
        with self._writes:
            self.abandoned_ended = True

    @property
    def abandoned(self) -> bool:
        """A transfer outlived its deadline: NIXL may still touch staging (and, for a WRITE, the client's buffer)."""
        return bool(self.abandoned_handles)

    def summary(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "mode": self.mode,
            "payload_bytes": self.desc.payload_bytes,
            "rate_bytes_s": self.flow.rate if self.flow else None,
            "timings_s": {k: round(v, 6) for k, v in self.timings.items()},
        }


class Aggregator:
    """Validates descriptors against the store and streams their deliveries."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.backings = {bucket: make_backing(config, bucket) for bucket in config.buckets}
        self._readers = ThreadPoolExecutor(max(2, config.io_threads), thread_name_prefix="s3agg-read")
        self.scheduler = (
            LinkScheduler(config.policy, config.bandwidth_cap_bytes_s, config.margin_bytes_s,
                          config.epoch_s, config.quantum_bytes)
            if config.bandwidth_cap_bytes_s > 0 else None
        )
        self.staging_budget = StagingBudget(config.max_staging_bytes)
        # Staging still referenced by NIXL after a deadline: kept until its transfers ended, never reused.
        self.staging_reaper = AbandonedTransfers("s3agg-staging-reaper")

    def prepare(self, request_id: str, desc: Descriptor) -> Job:
        """Control path: bucket, objects, mode, target registration; holds nothing that needs releasing."""
        started = time.monotonic()
        io = self.backings.get(desc.bucket)
        if io is None:
            raise DescriptorError(404, "NoSuchBucket", f"bucket {desc.bucket} is not served by this gateway")
        mode = MODE_LAYERWISE if desc.payload_bytes >= self.config.theta_bytes else MODE_CHUNKWISE
        plan = staging_plan(desc, mode == MODE_LAYERWISE, self.config.min_read_bytes,
                            self.config.max_request_staging_bytes)
        try:
            io.check_objects(desc)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise DescriptorError(502, "StoreUnavailable", f"checking the chunk objects failed: {exc}") from None
        remote = self._attach_target(io, desc.target) if isinstance(desc.target, NixlTarget) else None
        job = Job(request_id, desc, mode, io, remote, None, plan)
        job.timings["control_s"] = time.monotonic() - started
        return job

    def _admit(self, job: Job) -> None:
        """Join the link's next epoch (layerwise under a cap only); the stream leaves it when done."""
        if job.mode != MODE_LAYERWISE or self.scheduler is None:
            return
        started = time.monotonic()
        desc = job.desc
        window = desc.compute_window_s or self.config.default_compute_window_s
        # Digests count: the pacer sends each layer with its digests, so the demand declares the same bytes.
        demand = Demand(desc.layer_unit_bytes, window, desc.payload_bytes)
        job.flow = self.scheduler.admit(demand, self.config.io_timeout_s)
        job.timings["admission_s"] = time.monotonic() - started

    @staticmethod
    def _attach_target(io: Backing, target: NixlTarget) -> str:
        try:
            remote = io.agent.add_remote_agent(target.agent_metadata)
        except Exception as exc:  # NIXL raises its own error types for bad metadata
            raise DescriptorError(400, "InvalidTarget", f"agent_metadata not accepted by NIXL: {exc}") from None
        remote = remote.decode() if isinstance(remote, bytes) else remote
        # Preparing the whole target checks every region is memory the client
        # registered, before anything is read or written.
        try:
            handle = io.agent.prep_xfer_dlist(remote, descriptors(*target.spans()), "DRAM")
        except Exception:
            raise DescriptorError(
                400, "InvalidTarget", f"target regions are not memory registered by NIXL agent {remote}") from None
        io.agent.release_dlist_handle(handle)
        return remote

    def stream(self, job: Job) -> Iterator[Unit]:
        """Yield deliveries in order; reads of the next window overlap the current deliveries.

        The consumer must be done with a unit (sent or written) before asking for the next one.
        Admission to the link happens here, on the first unit asked for, so that a stream
        never started holds no bandwidth.
        """
        self._admit(job)
        try:
            units = self._whole_objects(job) if job.mode == MODE_CHUNKWISE else self._layer_windows(job)
            with contextlib.closing(units):
                for unit in units:
                    if job.flow is not None:
                        started = time.monotonic()
                        self.scheduler.send(job.flow, unit.nbytes, self.config.io_timeout_s)
                        job.timings["pacing_s"] += time.monotonic() - started
                    started = time.monotonic()
                    yield unit
                    job.timings["delivery_s"] += time.monotonic() - started
        finally:
            if job.flow is not None:
                self.scheduler.leave(job.flow)

    @contextlib.contextmanager
    def _staging(self, job: Job) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The job's registered DRAM staging buffer (``plan.nbytes``, taken from the staging budget) and the chunk
        objects registered for reads (their device ids)."""
        desc, agent, nbytes = job.desc, job.io.agent, job.plan.nbytes
        started = time.monotonic()
        self.staging_budget.take(nbytes, self.config.staging_wait_s)
        job.timings["staging_wait_s"] = time.monotonic() - started
        try:
            objects = job.io.objects(desc)
        except OSError as exc:  # a chunk removed since the check
            self.staging_budget.give_back(nbytes)
            raise StorageError(f"opening the chunk objects failed: {exc}") from None
        staging = np.empty(nbytes, dtype=np.uint8)
        dram_reg = agent.register_memory([(staging.ctypes.data, staging.nbytes, 0, "")], "DRAM")

        def free() -> None:
            objects.release()
            agent.deregister_memory(dram_reg)

        try:
            yield staging, objects.dev_ids
        finally:
            if job.abandoned:
                # The reaper keeps ``staging`` alive (NIXL may still write it) until every handle ended.
                def free_staging() -> None:
                    job.transfers_ended()  # a cancel of the request now answers that nothing can land
                    try:
                        free()
                    finally:  # a deregistration failing must not keep the bytes out of the budget for ever
                        self.staging_budget.give_back(nbytes)

                self.staging_reaper.hold(agent, job.abandoned_handles, free_staging, nbytes=nbytes,
                                         label=f"request {job.request_id}", memory=staging)
                logger.error("request %s: transfers abandoned; staging of %d bytes kept until they end",
                             job.request_id, nbytes)
            else:
                free()
                self.staging_budget.give_back(nbytes)

    def _read(self, job: Job, local: np.ndarray, remote: np.ndarray, what: str) -> None:
        """Object ranges into staging (descriptor rows: staging <- object range) through the backing's NIXL backend."""
        # One NIXL request per group, so the backend's threads (OBJ) or queue (POSIX) all work.
        groups = np.array_split(np.arange(len(local)), min(len(local), self.config.io_threads))
        started = time.monotonic()
        try:
            ok = run_nixl_transfers(job.io.agent, "READ", [(local[g], remote[g]) for g in groups], job.io.mem_type,
                                    self.config.io_timeout_s)
        except TransferAbandoned as exc:
            job.abandoned_handles.extend(exc.handles)  # NIXL may still write the staging buffer
            raise
        job.timings["storage_read_s"] += time.monotonic() - started
        if not all(ok):
            raise StorageError(f"ranged reads of {what} failed for {ok.count(False)} groups")

    def _read_objects(self, job: Job, staging: np.ndarray, dev_column: np.ndarray) -> np.ndarray:
        """Every chunk object in one GET (Full Block and trailer) into ``staging`` as ``(N, L*(S+D))``; the
        staging addresses of the objects.

        The trailers are zeroed first: the descriptor gives every size and nothing asks the store for it, so a
        short object leaves (part of) its digests zero, which its reader's integrity check refuses.
        """
        desc = job.desc
        n, size = desc.num_chunks, desc.object_bytes
        staging.reshape(n, size)[:, desc.full_block_bytes :] = 0
        starts = staging.ctypes.data + np.arange(n, dtype=np.int64) * size
        started = time.monotonic()
        self._read(job, descriptors(starts, size), descriptors(0, size, dev_column), "whole objects")
        job.timings["read_wait_s"] += time.monotonic() - started
        return starts

    def _whole_objects(self, job: Job) -> Iterator[Unit]:
        """Chunkwise: each stored object in one GET (Full Block and trailer), all delivered at once."""
        desc = job.desc
        with self._staging(job) as (staging, dev_column):
            starts = self._read_objects(job, staging, dev_column)
            layers = np.arange(desc.num_layers, dtype=np.int64)[None, :]
            yield Unit("chunks", 0, [staging.reshape(desc.num_chunks, desc.object_bytes)],
                       starts[:, None] + layers * desc.layer_bytes,
                       starts[:, None] + desc.full_block_bytes + layers * desc.digest_bytes, layers)

    def _layers_of_whole_objects(self, job: Job) -> Iterator[Unit]:
        """Layerwise with one window of every layer: one GET per object, then its layers one by one."""
        desc = job.desc
        s, d, full = desc.layer_bytes, desc.digest_bytes, desc.full_block_bytes
        with self._staging(job) as (staging, dev_column):
            starts = self._read_objects(job, staging, dev_column)
            objects = staging.reshape(desc.num_chunks, desc.object_bytes)
            for layer in range(desc.num_layers):
                yield Unit("layer", layer, [objects[:, layer * s : (layer + 1) * s],
                                            objects[:, full + layer * d : full + (layer + 1) * d]],
                           starts + layer * s, starts + full + layer * d, np.array(layer))  # fmt: skip

    def _layer_windows(self, job: Job) -> Iterator[Unit]:
        """Layerwise: windows of k layers, window w+1 read while window w is delivered, layer by layer."""
        desc, plan = job.desc, job.plan
        n, num_layers, s, d = desc.num_chunks, desc.num_layers, desc.layer_bytes, desc.digest_bytes
        if plan.whole_objects:
            # The trailer follows the last layer: one window of every layer is the whole object, one GET.
            yield from self._layers_of_whole_objects(job)
            return
        k = plan.window_layers
        windows = [(l0, min(k, num_layers - l0)) for l0 in range(0, num_layers, k)]
        # Two buffers alternate; a window holds its layers (N, kw, S), then their digests (kw, N, D); the
        # trailers (N, L, D) follow both.
        window_bytes = n * k * (s + d)
        nbuf, trailers_at = 2, 2 * window_bytes
        assert trailers_at + n * num_layers * d == plan.nbytes, "staging_plan and the windows disagree"
        with self._staging(job) as (staging, dev_column):
            base = staging.ctypes.data
            trailers = staging[trailers_at:].reshape(n, num_layers, d)
            chunks = np.arange(n, dtype=np.int64)

            def read(w: int) -> None:
                l0, kw = windows[w]
                local = descriptors(base + (w % nbuf) * window_bytes + chunks * kw * s, kw * s)
                remote = descriptors(l0 * s, kw * s, dev_column)
                if w == 0:
                    local = np.concatenate([local, descriptors(base + trailers_at + chunks * num_layers * d,
                                                               num_layers * d)])
                    remote = np.concatenate([remote, descriptors(desc.full_block_bytes, num_layers * d, dev_column)])
                self._read(job, local, remote, f"layers [{l0}, {l0 + kw})")

            pending: Future | None = self._readers.submit(read, 0)
            try:
                for w, (l0, kw) in enumerate(windows):
                    started = time.monotonic()
                    current, pending = pending, None
                    current.result()
                    job.timings["read_wait_s"] += time.monotonic() - started
                    if w + 1 < len(windows):
                        # Window w+1 goes into the buffer window w-1 used; all of it was delivered.
                        pending = self._readers.submit(read, w + 1)
                    offset = (w % nbuf) * window_bytes
                    blocks = staging[offset : offset + n * kw * s].reshape(n, kw, s)
                    digests = staging[offset + n * kw * s : offset + n * kw * (s + d)].reshape(kw, n, d)
                    digests[:] = trailers[:, l0 : l0 + kw, :].transpose(1, 0, 2)
                    block_at = base + offset + chunks * kw * s
                    digest_at = base + offset + n * kw * s + chunks * d
                    for i in range(kw):
                        yield Unit("layer", l0 + i, [blocks[:, i, :], digests[i]], block_at + i * s,
                                   digest_at + i * n * d, np.array(l0 + i))
            finally:
                if pending is not None:
                    try:
                        pending.result()
                    except Exception:  # already failing; the read's own error is not the one to report
                        pass

    def deliver_nixl(self, job: Job, unit: Unit) -> None:
        """WRITE one unit into the client's buffer; its notification says which layer(s) are ready."""
        desc, agent = job.desc, job.io.agent
        assert isinstance(desc.target, NixlTarget) and job.remote_agent is not None
        shape = unit.local.shape
        chunks = np.arange(desc.num_chunks, dtype=np.int64).reshape(-1, *([1] * (unit.local.ndim - 1)))
        remote, remote_digests = (np.broadcast_to(a, shape) for a in desc.target_addrs(chunks, unit.layers))
        # Layer Blocks, then their digests: wherever both sides are adjacent (a layer and its
        # digests with k = 1, a whole object chunk-major) the rows merge into one.
        lengths = np.concatenate([np.full(shape, desc.layer_bytes), np.full(shape, desc.digest_bytes)], axis=-1)
        local_rows, remote_rows = coalesce(
            descriptors(np.concatenate([unit.local, unit.digest_local], axis=-1), lengths),
            descriptors(np.concatenate([remote, remote_digests], axis=-1), lengths))
        notification = encode_notification(job.request_id, unit.index if unit.kind == "layer" else None)
        with job.write():
            try:
                handle = agent.initialize_xfer(
                    "WRITE", agent.get_xfer_descs(local_rows, "DRAM"), agent.get_xfer_descs(remote_rows, "DRAM"),
                    job.remote_agent, notification)
            except Exception as exc:
                raise DeliveryError(f"NIXL WRITE to {job.remote_agent} could not start: {exc}") from None
            state = "PROC"

            def ended() -> bool:
                nonlocal state
                state = agent.check_xfer_state(handle)
                return state != "PROC"

            try:
                state = agent.transfer(handle)
                if state == "PROC" and not wait_until(ended, self.config.io_timeout_s):
                    job.abandoned_handles.append(handle)  # the reaper releases it once it ended
                    raise TransferAbandoned("WRITE", 1, self.config.io_timeout_s)
            except TransferAbandoned:
                raise
            except Exception as exc:
                agent.release_xfer_handle(handle)
                raise DeliveryError(f"NIXL WRITE to {job.remote_agent} failed: {exc}") from None
            agent.release_xfer_handle(handle)
        if state != "DONE":
            raise DeliveryError(f"NIXL WRITE to {job.remote_agent} ended in state {state}")

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self._readers.shutdown(wait=True)
        self.staging_reaper.close()
        for io in self.backings.values():
            io.close()
