"""The store read path of a worker: hits read here, through the DE, and (on a DE) for a PE.

A load goes through four places, each once: :mod:`plan` plans where it
is read (here, by the DE, or split across both), this module fetches it,
:mod:`verify` checks what landed, :mod:`inject` copies it into the KV
cache.

A hit is read into a NIXL-registered host buffer, never straight into the KV
cache, so that a failed or partial read never leaves wrong bytes where
attention reads them. Where the bytes sit is a
:class:`~dualpath_connector.load.loaded_hit.LoadedHit`: slots of
this engine's load pool, or (read side ``de``) a DE's buffer lent to this
engine under a lease until it is released.

With a store that delivers per layer (the s3agg gateway) and ``load_mode:
layerwise``, a hit read here is *arriving* (:mod:`~dualpath_connector.load.arrivals`):
it is handed on once layer 0 landed and verified, and the read goes on landing
the other layers while the forward uses the first ones.

Reads here run on the read lane. A DE-side read waits for the DE on its own
thread, not on the read lane: waiting for a DE must not hold up this engine's
own store reads, or the two sides would take turns. A DE that cannot answer
in time (or declines at once because its read queue would not drain in time)
makes this engine read the hit itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from nixl_backends.buffers import HostBufferPool, PoolExhausted
from nixl_backends.deadlines import load_deadline
from nixl_backends.integrity import ChunkIntegrity
from nixl_backends.s3agg_protocol import LAYOUT_CHUNK_MAJOR, LAYOUT_STRIDED
from nixl_backends.abandoned import process_reaper, retire_slots
from nixl_backends.store import KVStore, TransferAbandoned

from dualpath_connector.lanes.affinity import pin_current_thread
from dualpath_connector.load.arrivals import LayerArrivals
from dualpath_connector.load.verify import HitVerifier, leading_run
from dualpath_connector.lanes.io_lanes import IOLane
from dualpath_connector.load.loaded_hit import LoadedHit, RemoteBuffer
from dualpath_connector.metadata import LoadSpec
from dualpath_connector.pd.peer import PeerLink
from dualpath_connector.protocol import RELEASE, ReadAnswer, ReadRequest, StoreKeySpace
from dualpath_connector.load.read_queue import StoreReadQueue
from dualpath_connector.load.plan import PartsJoin, ReadPlan, plan_read, routed_to_de, split_spec
from dualpath_connector.load.read_timeline import ReadSpan, ReadTimeline
from dualpath_connector.pd.side_channel import PeerBusy, PeerTimeout
from dualpath_connector.metrics.stats_recorder import StatsRecorder

logger = logging.getLogger(__name__)

# PE: DE-side reads waited for at once (one thread each).
_DE_READ_THREADS = 8


class HitReader:
    def __init__(
        self,
        *,
        store: KVStore,
        pool: HostBufferPool,
        block_size: int,
        key_space: StoreKeySpace,
        integrity: ChunkIntegrity,
        kv_dtype: torch.dtype,
        peers: PeerLink | None,
        lane: IOLane,
        stats: StatsRecorder,
        de_read_timeout_s: float,
        cores: set[int] | None,
        move_queued_reads: bool = False,
        split_read_min_tokens: int = 0,
        moved_read_min_deadline_s: float = 0.0,
        timeline: ReadTimeline | None = None,
        layer_arrival: bool = False,
        compute_window_s: Callable[[], float | None] = lambda: None,
        recompute_s: Callable[[int], float | None] = lambda tokens: None,
        repair_timeout_s: float | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.block_size = block_size
        self.key_space = key_space
        self.verifier = HitVerifier(store=store, pool=pool, key_space=key_space, integrity=integrity, kv_dtype=kv_dtype,
                                    stats=stats)  # fmt: skip
        self.peers = peers
        self.lane = lane
        self.stats = stats
        self.de_read_timeout_s = de_read_timeout_s
        self.move_queued_reads = move_queued_reads
        self.split_read_min_tokens = split_read_min_tokens
        self.moved_read_min_deadline_s = moved_read_min_deadline_s
        self.timeline = timeline
        # Hits read here arrive layer by layer (the store delivers per layer, the loads are layerwise).
        self.layer_arrival = layer_arrival and store.delivers_layers
        # The forward's measured per-layer compute time, declared to the store's bandwidth scheduler.
        self.compute_window_s = compute_window_s
        # This engine's estimated time to recompute n tokens: a load's store retries end by then.
        self.recompute_s = recompute_s
        # How long a forward waits for a repair's store read (a DE's READ failed mid-forward); None: unbounded.
        self.repair_timeout_s = repair_timeout_s
        self.read_queue = StoreReadQueue()
        # From a slot's layer l to its layer l + 1, as a PE reading this engine's buffer must step.
        self._layer_stride = pool.layer_stride if pool.layer_major else key_space.layout.layer_block_bytes
        self._de_reads = ThreadPoolExecutor(
            max_workers=_DE_READ_THREADS,
            thread_name_prefix="dualpath-de-read",
            initializer=pin_current_thread,
            initargs=(cores,),
        )

    # -- submitting loads -------------------------------------------------------

    def submit_here(self, spec: LoadSpec, on_read: Callable[[LoadedHit], None]) -> None:
        """Read ``spec``'s hit on the read lane; ``on_read`` gets it there (no chunks if the read failed)."""
        # The read queue is what the router balances: tokens this engine has
        # yet to read from the store, counted from the moment they queue.
        tokens = spec.num_blocks() * self.block_size
        self._count_queue(tokens)
        timed = ReadSpan(self.timeline, "own", tokens)
        # Recompute would have started now: failed store requests are not sent again past the time it would take.
        recompute_s = self.recompute_s(tokens)
        deadline = None if recompute_s is None else time.monotonic() + recompute_s

        def job() -> None:
            timed.started()
            if self.layer_arrival:
                try:
                    with load_deadline(deadline):
                        self.read_arriving(spec, on_read)
                finally:
                    self._count_queue(-tokens)
                    timed.finished("read", len(spec.chunks))
                return
            try:
                with load_deadline(deadline):
                    hit = self._guarded(spec, lambda: self.read_here(spec))
            finally:
                self._count_queue(-tokens)
            timed.finished("read" if hit.chunks else "failed", len(hit.chunks))
            on_read(hit)

        self.lane.submit(job)

    def submit_through_de(self, spec: LoadSpec, on_read: Callable[[LoadedHit], None], deadline_s: float) -> None:
        """Ask ``spec``'s DE to read the hit within ``deadline_s``; if it cannot, read it here."""

        def job() -> None:
            hit = self._guarded(spec, lambda: self.read_through_de(spec, deadline_s))
            if hit is None:
                self.submit_here(spec, on_read)
            else:
                on_read(hit)

        self._de_reads.submit(job)

    def plan(self, spec: LoadSpec) -> ReadPlan:
        """Where ``spec``'s hit is read (:mod:`plan`): the router's read side, then this engine's links.

        Work stealing between the two storage links: a PE-side read that would
        queue behind this engine's own is offered whole to the DE, a long one is
        split so both links read it at once; the DE gets the time the whole read
        would take here as its deadline.
        """
        if spec.read_side == "de":
            return routed_to_de(self.de_read_timeout_s)
        if not self.move_queued_reads or spec.de_side_channel is None or self.peers is None:
            return ReadPlan(len(spec.chunks))
        return plan_read(
            num_chunks=len(spec.chunks),
            chunk_tokens=self.key_space.chunk_tokens,
            hit_tokens=spec.num_blocks() * self.block_size,
            queued_tokens=self.read_queue.queued_tokens,
            tokens_per_s=self.read_queue.tokens_per_s,
            max_deadline_s=self.de_read_timeout_s,
            split_min_tokens=self.split_read_min_tokens,
            min_deadline_s=self.moved_read_min_deadline_s,
        )

    def fetch(self, spec: LoadSpec, plan: ReadPlan, on_parts: Callable[[list[LoadedHit]], None]) -> None:
        """Read ``spec``'s hit as ``plan`` says; ``on_parts`` gets it as parts that form a prefix of it.

        The DE takes what it is offered only if its own queue lets it finish
        within the plan's deadline, and declines at once otherwise (then it is
        read here). A DE read that can no longer end in time is declined
        before it starts; one that still ends late is read here as well
        (``de_read_fallbacks``).
        """
        logger.debug("request %s: read %s (%d of %d chunks here, DE deadline %s s)", spec.req_id, plan.kind,
                     plan.head_chunks, len(spec.chunks), plan.deadline_s)  # fmt: skip
        if plan.kind == "here":
            self.submit_here(spec, lambda hit: on_parts([hit]))
        elif plan.kind == "through_de":

            def on_through_de(hit: LoadedHit) -> None:
                if hit.remote is not None and not plan.routed:
                    self.stats.add(reads_moved_to_de=1)
                on_parts([hit])

            self.submit_through_de(spec, on_through_de, plan.deadline_s)
        else:
            self._fetch_split(spec, plan, on_parts)

    def _fetch_split(self, spec: LoadSpec, plan: ReadPlan, on_parts: Callable[[list[LoadedHit]], None]) -> None:
        head, tail = split_spec(spec, plan.head_chunks)
        join = PartsJoin(plan.head_chunks, on_parts, self.release)

        def on_tail(hit: LoadedHit) -> None:
            if hit.remote is not None:
                self.stats.add(split_read_tail_tokens=hit.block_ids().size * self.block_size)
            join.tail(hit)

        self.submit_here(head, join.head)
        self.submit_through_de(tail, on_tail, plan.deadline_s)

    @staticmethod
    def _guarded(spec: LoadSpec, read: Callable[[], LoadedHit | None]) -> LoadedHit | None:
        try:
            return read()
        except Exception:
            # Whatever went wrong, the request must still be reported, or it
            # would wait in WAITING_FOR_REMOTE_KVS forever.
            logger.exception("request %s: load failed", spec.req_id)
            return LoadedHit(spec.req_id, [])

    def _count_queue(self, tokens: int) -> None:
        self.stats.gauge(read_queue_tokens=self.read_queue.add(tokens))

    # -- reading ----------------------------------------------------------------

    def read_here(self, spec: LoadSpec) -> LoadedHit:
        """Read the hit from the store into this engine's pool; the leading readable chunks."""
        slots = self.pool.acquire(len(spec.chunks))
        try:
            ok = self._store_read([c.chunk_hash for c in spec.chunks], slots)
        except TransferAbandoned as exc:
            retire_slots(exc, self.pool, slots, f"request {spec.req_id}: a read")
            raise
        except BaseException:
            self.pool.release(slots)
            raise
        readable = leading_run(ok)
        self.pool.release(slots[readable:])
        self.stats.add(bytes_read=readable * self.key_space.layout.full_block_bytes)
        return LoadedHit(spec.req_id, spec.chunks[:readable], slots=slots[:readable])

    def read_arriving(self, spec: LoadSpec, on_read: Callable[[LoadedHit], None]) -> None:
        """Read the hit layer by layer into the pool; ``on_read`` gets it once, when layer 0 verified.

        A read that fails before layer 0 is retried as a whole-object read (a
        chunk evicted since the lookup is then a shorter hit, not a lost one);
        one that fails later ends the arrivals, and the forward fails what is
        missing.
        """
        chunk_hashes = [c.chunk_hash for c in spec.chunks]
        try:
            slots = self.pool.acquire(len(spec.chunks))
        except Exception:
            logger.exception("request %s: load failed", spec.req_id)
            on_read(LoadedHit(spec.req_id, []))
            return
        arrivals = LayerArrivals(self.key_space.layout.num_layers)
        hit = LoadedHit(spec.req_id, list(spec.chunks), slots=slots, arrivals=arrivals)
        good = len(spec.chunks)

        def on_layer(layer: int) -> None:
            nonlocal good
            good = self.verifier.layer(chunk_hashes, slots, layer, good)
            arrivals.land(layer, good)
            if layer == 0:
                hit.chunks = spec.chunks[:good]
                if not good:
                    self.release([hit])  # reported as a failed load; the slots return once the read ends
                on_read(hit)

        if self.pool.layer_major:  # each layer of the hit lands as one host run
            target = {"layout": LAYOUT_STRIDED, "trailer_addrs": [self.pool.trailer_addr(s) for s in slots],
                      "layer_stride": self.pool.layer_stride}  # fmt: skip
        else:
            target = {"layout": LAYOUT_CHUNK_MAJOR}
        read_tokens = 0
        self.read_queue.read_started()
        try:
            self.store.read_layerwise([self.key_space.key(h) for h in chunk_hashes], [self.pool.slot_addr(s) for s in slots],
                                      on_layer, compute_window_s=self.compute_window_s(), **target)  # fmt: skip
            read_tokens = good * self.key_space.chunk_tokens
        except TransferAbandoned as exc:
            arrivals.end(str(exc), abandoned=True)
            if arrivals.last_landed_at() is None:
                retire_slots(exc, self.pool, slots, f"request {spec.req_id}: a read")
                on_read(LoadedHit(spec.req_id, []))
            else:
                # The hit and its slots went to the forward: they come back through its release, which waits
                # for the arrivals to end, and they end for the slots once NIXL's transfers did.
                logger.error("request %s: store read abandoned after layer 0; %d load slots retired until its "
                             "transfers end", spec.req_id, len(slots))  # fmt: skip
                process_reaper().hold_abandoned(exc, arrivals.transfers_ended, nbytes=len(slots) * self.pool.slot_bytes,
                                                label=f"request {spec.req_id}: {len(slots)} arriving load slots")
            return
        except Exception as exc:
            arrivals.end(f"{type(exc).__name__}: {exc}")
            if arrivals.last_landed_at() is None:
                logger.warning("request %s: layerwise store read failed (%s); reading whole objects", spec.req_id, exc)
                self.pool.release(slots)
                on_read(self._guarded(spec, lambda: self.read_here(spec)))
            else:
                logger.warning("request %s: layerwise store read failed after layer 0: %s", spec.req_id, exc)
            return
        finally:
            self.read_queue.read_finished(read_tokens)
        arrivals.end()
        self.stats.add(bytes_read=good * self.key_space.layout.full_block_bytes)

    def _store_read(self, chunk_hashes: list[str], slots: list[int]) -> list[bool]:
        """Read chunks into load-pool slots and verify them; the read time feeds the read-rate estimate.

        A chunk whose bytes fail their checks is unreadable like a missing
        one (the hit ends before it), so no byte of it reaches a KV cache.
        """
        keys = [self.key_space.key(h) for h in chunk_hashes]
        ok: list[bool] = []
        self.read_queue.read_started()
        try:
            if self.pool.layer_major:  # the worker chose it because the store reads into pieces
                ok = self.store.read_segments(keys, [self.pool.slot_segments(s) for s in slots])
            else:
                ok = self.store.read(keys, [self.pool.slot_addr(s) for s in slots])
        finally:
            self.read_queue.read_finished(sum(ok) * self.key_space.chunk_tokens)
        return self.verifier.whole(chunk_hashes, slots, ok)

    def read_through_de(self, spec: LoadSpec, timeout_s: float) -> LoadedHit | None:
        """Ask the DE to read the hit into its buffer within ``timeout_s``; None if it cannot (then this engine reads)."""
        address = spec.de_side_channel
        request = ReadRequest(self.key_space.digest, [c.chunk_hash for c in spec.chunks], timeout_s, spec.keep_token)
        try:
            peer = self.peers.peer(address, timeout_s)
            sent = time.monotonic()  # the DE counts its lease from receiving the request, which is later
            message = self.peers.request(address, request.to_message(), timeout_s)
            answer = ReadAnswer.from_message(message, len(spec.chunks))
        except PeerBusy as exc:
            # Declined at once (the DE counts it): no time lost, and the peer is healthy.
            logger.info("request %s: %s; reading the hit here", spec.req_id, exc)
            return None
        except PeerTimeout as exc:
            # Late is not dead: other requests may be READing hits from its buffer right now, and forgetting
            # the peer would fail them. A dead DE fails those transfers, and they forget it.
            logger.warning("request %s: DE %s did not read the hit in time (%s); reading it here", spec.req_id,
                           address, exc)  # fmt: skip
            self.stats.add(de_read_fallbacks=1)
            return None
        except Exception as exc:
            logger.warning("request %s: DE %s did not read the hit (%s); reading it here", spec.req_id, address, exc)
            self.peers.forget(address)
            self.stats.add(de_read_fallbacks=1)
            return None
        if not answer.readable:
            return LoadedHit(spec.req_id, [])
        remote = RemoteBuffer(address, peer, answer.lease, answer.chunk_addrs, answer.layer_stride, sent + answer.lease_s)
        return LoadedHit(spec.req_id, spec.chunks[: answer.readable], remote=remote)

    def repair(self, hit: LoadedHit) -> None:
        """A READ from the DE failed after the hit was reported: read the same chunks here.

        Runs on the read lane ahead of queued reads and waits for it. On the
        forward thread (layerwise) this stalls the step, but the KV must be
        right before attention runs; a store that cannot serve it either
        leaves no correct answer, so that is an error.
        """
        remote, hit.remote = hit.remote, None
        if remote.expired():
            # The DE is fine; its lease of the buffer ran out before this engine's READ ended.
            logger.warning("request %s: DE %s's lease of the hit's buffer ended before the READ did; reading the "
                           "hit from the store here", hit.req_id, remote.address)  # fmt: skip
        else:
            logger.warning("request %s: READ from DE %s failed; reading the hit from the store here", hit.req_id,
                           remote.address)  # fmt: skip
            self.peers.forget(remote.address)
        self.stats.add(de_read_fallbacks=1)
        result: list[LoadedHit] = []
        given_up = False
        lock = threading.Lock()

        def read() -> None:
            loaded = self.read_here(LoadSpec(hit.req_id, hit.chunks))
            with lock:
                if given_up:  # the forward stopped waiting: nobody will use or release these slots
                    self.release([loaded])
                else:
                    result.append(loaded)

        ended = self.lane.run_now(read, self.repair_timeout_s)
        with lock:
            # Nothing loaded yet: read() releases what it loads later. A read that ended between the deadline
            # and this lock is used all the same (clearing it would leak its slots).
            given_up = not result
        if not result or len(result[0].chunks) != len(hit.chunks):
            if result:
                self.release(result)
            why = "unreadable from the store" if ended else f"not read from the store in {self.repair_timeout_s} s"
            raise RuntimeError(f"request {hit.req_id}: hit KV lost with its DE and {why}")
        hit.slots = result[0].slots

    def release(self, hits: list[LoadedHit]) -> None:
        """Hand each hit's buffer back: pool slots here, or the DE's lease."""
        for hit in hits:
            if hit.remote is not None:
                self.peers.notify(hit.remote.peer.agent, RELEASE + hit.remote.lease.encode())
                hit.remote = None
            if hit.slots:
                slots, hit.slots = hit.slots, []
                if hit.arrivals is not None:
                    # The store may still be landing layers into them.
                    hit.arrivals.when_ended(lambda slots=slots: self.pool.release(slots))
                else:
                    self.pool.release(slots)

    # -- serving a PE (DE side) ---------------------------------------------------

    def serve_peer(self, request: ReadRequest, reply: Callable[[dict[str, Any]], None]) -> None:
        """A PE asked this engine to read a hit into its buffer within the deadline (side-channel thread)."""
        tokens = len(request.chunk_hashes) * self.key_space.chunk_tokens
        timed = ReadSpan(self.timeline, "for_peer", tokens)
        reason = self.read_queue.decline_reason(tokens, request.deadline_s)
        if reason is not None:
            self._decline(reason, reply)
            timed.finished("declined")
            return
        self._count_queue(tokens)
        received = time.monotonic()

        def job() -> None:
            timed.started()
            try:
                # The estimate at arrival can be off (reads slowed down): a read
                # that can no longer end in time is not started, so the PE
                # reads it once, itself, rather than both sides reading it.
                left_s = request.deadline_s - (time.monotonic() - received)
                late = self.read_queue.decline_reason(tokens, left_s, 0)
                if late is not None:
                    self._decline(late, reply)
                    timed.finished("declined")
                else:
                    # The PE reads the hit itself after its deadline: retries past it would be wasted.
                    with load_deadline(received + request.deadline_s):
                        answer = self._read_for_peer(request, received)
                    reply(answer)
                    readable = answer.get("readable", 0)
                    timed.finished("read" if readable else "failed", readable)
            finally:
                self._count_queue(-tokens)

        self.lane.submit(job)

    def _decline(self, reason: str, reply: Callable[[dict[str, Any]], None]) -> None:
        self.stats.add(de_reads_declined=1)
        reply({"error": reason, "busy": True})

    def _read_for_peer(self, request: ReadRequest, received: float) -> dict[str, Any]:
        chunk_hashes = request.chunk_hashes
        try:
            slots = self.pool.acquire(len(chunk_hashes))
        except PoolExhausted:
            return {"error": f"host buffer has no room for {len(chunk_hashes)} chunks"}
        try:
            ok = self._store_read(chunk_hashes, slots)
        except TransferAbandoned as exc:
            retire_slots(exc, self.pool, slots, "a read for a peer")
            return {"error": "store read timed out"}
        except Exception as exc:
            self.pool.release(slots)
            return {"error": f"store read failed: {exc}"}
        readable = leading_run(ok)
        self.pool.release(slots[readable:])
        nbytes = readable * self.key_space.layout.full_block_bytes
        self.stats.add(bytes_read=nbytes, bytes_read_for_peer=nbytes)
        if not readable:
            return ReadAnswer(0, None, []).to_message()
        lease, lease_s = self.peers.lease(self.pool, slots[:readable], received, request.keep_token,
                                          chunk_hashes[:readable])  # fmt: skip
        return ReadAnswer(readable, lease, [self.pool.slot_addr(s) for s in slots[:readable]], self._layer_stride,
                          lease_s).to_message()  # fmt: skip

    def shutdown(self) -> None:
        self._de_reads.shutdown(wait=True, cancel_futures=True)
