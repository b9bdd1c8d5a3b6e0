"""Scheduler half: finds hits in the store, plans loads and saves, emits per-step metadata."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nixl_backends.gc import GcError, open_chunks
from nixl_backends.layout import KVNamespace, chunk_hashes, isolated_chain
from nixl_backends.lookup import PresentChunks
from nixl_backends.registry import for_rank, make_store
from nixl_backends.removals import RemovalLog
from nixl_backends.store import KVStore

from dualpath_connector.config import ChunkGeometry, DualPathConfig, kv_events_enabled, shard_namespaces
from dualpath_connector.metrics.kv_events import RemovalWatcher, StorageEvents
from dualpath_connector.scheduler.lookup_lane import LookupLane
from dualpath_connector.metadata import (
    ChunkLoad,
    DualPathMetadata,
    LoadSpec,
    PullSpec,
    SavedChunks,
    SaveSpec,
    SendSpec,
)
from dualpath_connector.protocol import (
    RETAINED_CHECKPOINTS,
    PrefillHandoff,
    PrefillRequest,
    ProtocolError,
    RetainedDecode,
    ShardedKeySpace,
    StoreKeySpace,
    new_hold_token,
    new_keep_token,
)
from dualpath_connector.metrics.stats import DualPathStats
from dualpath_connector.metrics.stats_recorder import StatsRecorder

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# After this many loads of one request failed, it is served without the store:
# the store may keep calling a chunk present that cannot be read.
MAX_LOAD_ATTEMPTS = 2
# Writes still counted in flight keep the engine stepping, so their stats and KV events are handed on;
# a count a worker never reports (a rank gone, a lane that raised) stops doing so after this long
# without any write planned or finished: only those metrics and events then wait for the next request.
WRITES_DRAIN_GIVE_UP_S = 120.0


def request_chain(namespace_digest: str, request: Request) -> str:
    """The digest ``request``'s chunk hashes chain from: its own for a salt or a LoRA adapter (isolated_chain)."""
    lora = request.lora_request
    return isolated_chain(
        namespace_digest,
        cache_salt=getattr(request, "cache_salt", None),
        lora=(lora.lora_name, lora.lora_path) if lora is not None else None,
    )


@dataclass
class _RequestState:
    request: Request
    # What its chunk hashes chain from (request_chain): the namespace, or a salt's or adapter's own.
    chain: str
    # Hashes of the request's full chunks computed so far (extended lazily).
    hashes: list[str] = field(default_factory=list)
    # Leading chunks known to be in the store; saving starts after them.
    stored_chunks: int = 0
    # Chunks handed to the worker for saving (or known stored).
    saved_chunks: int = 0
    # After a failed load, chunks before this one are saved only where the store lacks them (SaveSpec.only_missing).
    resave_until: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Loads issued for this request; a second ask follows a failed load.
    loads_issued: int = 0
    # PE: the router asked for prefill only; the DE decodes and saves the chunks decoding completes.
    remote_decode: PrefillRequest | None = None
    # DE: the PE's hand-off, until the pull is planned.
    remote_prefill: PrefillHandoff | None = None
    # PE, when the router named the decoding DE: (keep token, first chunk, chunks) of the hit that DE keeps if it
    # reads it (read side "de", or a read moved there).
    kept: tuple[str, int, int] | None = None
    # Where its last planned external hit comes from, for vLLM's hit metrics: "p2p" (pulled from a peer) or "store".
    hit_source: str | None = None
    # PE: the DE's retained decode of the conversation's last turn, until its pull is planned, and the leading
    # chunks pulled from it; asked once (after a failed pull the store is asked).
    retained: RetainedDecode | None = None
    retained_chunks: int = 0
    retained_asked: bool = False


class DualPathScheduler:
    """The scheduler half, built from its collaborators (no vLLM config needed: unit-testable)."""

    def __init__(
        self,
        config: DualPathConfig,
        kv_role: str,
        geometry: ChunkGeometry,
        namespace: KVNamespace,
        store: KVStore,
        *,
        shards: Sequence[KVNamespace] = (),
        tp_size: int = 1,
        kv_events: bool = False,
        spec_kind: str | None = None,
        lookup_executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_role = kv_role
        self.geometry = geometry
        self.key_space = StoreKeySpace.of(namespace, config.key_prefix)
        # Lookups ask for every rank's shard of a chunk: a chunk is a hit only when all are stored.
        digests = [shard.digest() for shard in shards] or [self.key_space.digest]
        self._lookup_keys = ShardedKeySpace.with_shards(self.key_space, digests)
        self.store = store
        # PD: the hand-off names the PE's size; rank r pulls from rank r, so a DE takes only its own size's.
        self.tp_size = tp_size
        self._present = PresentChunks(
            config.lookup_cache_chunks, ttl_s=config.lookup_cache_ttl_s, absent_ttl_s=config.lookup_absent_ttl_s,
            clock=clock,
        )
        # Store lookups off the scheduler thread (get_num_new_matched_tokens answers None meanwhile).
        self._lookups = LookupLane(self._present, lambda: self.store, lookup_executor)
        # Whether the last step computed anything: an idle engine's lookups wait on the scheduler thread.
        self._engine_busy = False
        self._states: dict[str, _RequestState] = {}
        # Hit found by get_num_new_matched_tokens, consumed by update_state_after_alloc.
        self._pending_hit_chunks: dict[str, int] = {}
        self._loads: list[LoadSpec] = []
        self._pulls: list[PullSpec] = []
        self._sends: list[SendSpec] = []
        self._dropped: list[str] = []
        self._last_lookup_error_log = 0.0
        self._clock = clock
        # SaveSpec writes planned and not yet reported finished, summed over the ranks that write.
        self._writes_in_flight = 0
        self._writes_drain_until = 0.0
        self.stats = StatsRecorder()
        # vLLM KV events for the store's blocks (kv_events.py); None: not announced.
        self.events = None
        if kv_events:
            self.events = StorageEvents(
                block_size=geometry.block_size,
                blocks_per_chunk=geometry.blocks_per_chunk,
                world_size=self._lookup_keys.keys_per_chunk,
                max_queued=config.kv_events_max_queued,
                tracked_chunks=config.lookup_cache_chunks,
                stats=self.stats,
                token_ids=config.kv_events_token_ids,
                locality=config.kv_events_locality,
                spec_kind=spec_kind,
            )
        self.removal_watcher: RemovalWatcher | None = None
        logger.info(
            "DualPath scheduler: namespace %s, chunk %d tokens, store %s",
            self.key_space.digest,
            self.geometry.chunk_tokens,
            type(self.store).__name__,
        )

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, config: DualPathConfig, kv_role: str) -> DualPathScheduler:
        geometry = ChunkGeometry.of(config, vllm_config)
        # Chunk hashes chain from rank 0's namespace; each rank stores its own
        # shard (MLA: one for all ranks), and a hit needs every shard.
        shards = shard_namespaces(vllm_config, config, geometry.chunk_tokens)
        namespace = shards[0]
        # Lookup only: no NIXL agent here.
        store = make_store(for_rank(config.store_config, 0, 0), StoreKeySpace.of(namespace, config.key_prefix).layout)
        kv_events = kv_events_enabled(vllm_config, config)
        scheduler = cls(
            config, kv_role, geometry, namespace, store,
            shards=shards, tp_size=vllm_config.parallel_config.tensor_parallel_size, kv_events=kv_events,
            # vLLM's KVCacheSpecKind of the cache stored (its events name it): the attention this connector serves.
            spec_kind="mla_attention" if vllm_config.model_config.use_mla else "full_attention",
        )  # fmt: skip
        if kv_events and config.kv_events_gc_poll_s > 0:
            scheduler.watch_removals(config.kv_events_gc_poll_s)
        return scheduler

    def watch_removals(self, interval_s: float) -> None:
        """Announce ``BlockRemoved`` for announced chunks that ``dualpath-kv gc`` deleted (its removal records)."""
        assert self.events is not None
        try:
            objects = open_chunks(self.config.store_config, self.config.key_prefix, [self.key_space.digest])
        except GcError:
            logger.info("KV events: the store is a local tier only (no gc); no BlockRemoved from gc")
            return
        # Its own store: the watcher's lookups run on its thread.
        store = make_store(for_rank(self.config.store_config, 0, 0), self.key_space.layout)
        self.removal_watcher = RemovalWatcher(
            RemovalLog(objects, self.config.key_prefix),
            self.key_space.digest,
            store,
            self.key_space.key,
            self.events,
            self.stats,
            interval_s,
        )

    # -- hashing and lookup ---------------------------------------------------

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            chain = request_chain(self.key_space.chain_digest, request)
            state = self._states[request.request_id] = _RequestState(request, chain)
        return state

    def _hashes(self, state: _RequestState, num_tokens: int) -> list[str]:
        wanted = num_tokens // self.geometry.chunk_tokens
        have = len(state.hashes)
        if wanted > have:
            state.hashes.extend(
                chunk_hashes(
                    state.chain,
                    state.request.all_token_ids[: wanted * self.geometry.chunk_tokens],
                    self.geometry.chunk_tokens,
                    start_chunk=have,
                    previous_hash=state.hashes[-1] if have else None,
                )
            )
        return state.hashes[:wanted]

    # -- vLLM scheduler hooks -------------------------------------------------

    @staticmethod
    def _cacheable(request: Request) -> bool:
        # Token ids (and the chain: salt, adapter) do not name these requests' KV: images and prompt embeddings
        # change it behind the same ids.
        return not (request.mm_features or getattr(request, "prompt_embeds", None) is not None)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.kv_role == "kv_consumer":
            handoff = self._parsed(request, PrefillHandoff)
            if handoff is not None and handoff.tp_size != self.tp_size:
                logger.warning(
                    "request %s: ignoring the hand-off of a PE with tensor parallel size %d (this DE: %d); "
                    "recomputing the prompt, the PE's blocks are freed when its hold expires",
                    request.request_id, handoff.tp_size, self.tp_size,
                )  # fmt: skip
                handoff = None
            if handoff is not None:
                # The whole prompt was prefilled by a PE; vLLM itself recomputes
                # the last token to sample the next one.
                self._state(request).remote_prefill = handoff
                count = max(0, len(request.prompt_token_ids or ()) - num_computed_tokens)
                return count, count > 0
        state = self._state(request)
        if self.kv_role == "kv_producer":
            # Before the cacheability check: a multimodal or embeddings prompt is
            # still handed to its DE, it only never touches the store.
            state.remote_decode = self._parsed(request, PrefillRequest)
        if not self._cacheable(request):
            return 0, False
        if self.kv_role == "kv_producer" and (state.retained is not None or not state.retained_asked):
            retained = self._retained_hit(state, num_computed_tokens)
            if retained > 0:
                return retained, True
        if state.loads_issued >= MAX_LOAD_ATTEMPTS:
            return 0, False
        # Never claim the last token: vLLM must compute it to sample the next one.
        claimable = (request.num_tokens - 1) // self.geometry.chunk_tokens
        hashes = self._hashes(state, claimable * self.geometry.chunk_tokens)
        keys = self._lookup_keys.object_keys(hashes)
        if state.loads_issued:
            # vLLM asks again after a load failed: what the cache remembers as
            # present may be what failed, so ask the store itself.
            self._present.forget(keys)
        try:
            present = self._lookups.answer(
                request.request_id, keys, background=self._engine_busy and self.config.lookup_in_background
            )
            if present is not None:
                present //= self._lookup_keys.keys_per_chunk  # whole chunks
        except Exception as exc:  # a store outage is a miss, never a dead scheduler
            self._log_lookup_error(exc)
            present = 0
        if present is None:
            # The store is being asked on the lookup lane: vLLM schedules the others and asks again next step.
            return None, False
        if state.loads_issued:
            # A re-ask after a failed load: the store's fresh answer replaces
            # what was known stored, so chunks it lost are saved again.
            state.resave_until = max(state.resave_until, state.saved_chunks)
            state.stored_chunks = state.saved_chunks = present
        else:
            state.stored_chunks = max(state.stored_chunks, present)
            state.saved_chunks = max(state.saved_chunks, present)
        # One request's hit must fit the load buffer.
        first_chunk = num_computed_tokens // self.geometry.chunk_tokens
        hit_chunks = min(present, first_chunk + self.config.load_buffer_chunks)
        hit_tokens = hit_chunks * self.geometry.chunk_tokens - num_computed_tokens
        if hit_tokens <= 0:
            self._pending_hit_chunks.pop(request.request_id, None)
            return 0, False
        self._pending_hit_chunks[request.request_id] = hit_chunks
        return hit_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        state.block_ids = list(blocks.get_block_ids()[0])
        if state.remote_prefill is not None:
            state.hit_source = "p2p"
            self._plan_pull(state, num_external_tokens)
            return
        if state.retained is not None:
            state.hit_source = "p2p"
            self._plan_retained_pull(state, num_external_tokens)
            return
        hit_chunks = self._pending_hit_chunks.pop(request.request_id, 0)
        if num_external_tokens == 0 or hit_chunks == 0:
            return
        state.hit_source = "store"
        hit_end = hit_chunks * self.geometry.chunk_tokens
        local_blocks = (hit_end - num_external_tokens) // self.geometry.block_size
        chunks = []
        for chunk in range(local_blocks // self.geometry.blocks_per_chunk, hit_chunks):
            first_block = chunk * self.geometry.blocks_per_chunk
            skip = max(0, local_blocks - first_block)
            chunks.append(
                ChunkLoad(
                    chunk_hash=state.hashes[chunk],
                    first_sub_block=skip,
                    block_ids=state.block_ids[first_block + skip : first_block + self.geometry.blocks_per_chunk],
                )
            )
        remote = state.remote_decode
        spec = LoadSpec(request.request_id, chunks)
        if remote is not None:
            spec.read_side, spec.de_side_channel = remote.read_side, remote.de_side_channel
        if spec.de_side_channel is not None:
            # The DE that decodes the request may read the hit (read side "de",
            # or a read moved there while this engine's link is busy): it then
            # keeps it and pulls only what this engine computed (paper §4.1).
            first_chunk = local_blocks // self.geometry.blocks_per_chunk
            spec.keep_token = new_keep_token()
            state.kept = (spec.keep_token, first_chunk, hit_chunks - first_chunk)
        self._loads.append(spec)
        state.loads_issued += 1
        logger.debug("request %s: loading %d tokens from the store", request.request_id, num_external_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's ``CacheHitSource`` of a request's external hit, planned by :meth:`update_state_after_alloc`: P2P
        for a pull from the PE; for a store hit DISK where the store is this machine's (``kv_events_locality``
        LOCAL), else EXTERNAL_UNSPECIFIED, vLLM's label for a remote store."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if num_external_tokens == 0:
            return {}
        state = self._states.get(request.request_id)
        if state is not None and state.hit_source == "p2p":
            return {CacheHitSource.P2P: num_external_tokens}
        local = self.config.kv_events_locality == "LOCAL"
        return {CacheHitSource.DISK if local else CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}

    @staticmethod
    def _parsed(request: Request, message: type[PrefillRequest] | type[PrefillHandoff]) -> Any:
        """The request's ``kv_transfer_params`` as ``message``; None if absent or unusable.

        Unusable parameters (another protocol version, bad types) serve the
        request without a hand-off: a PE computes and saves it itself, a DE
        recomputes the prompt. Never a wrong KV, never a dead engine.
        """
        try:
            parsed = message.from_dict(request.kv_transfer_params)
        except ProtocolError as exc:
            logger.warning("request %s: ignoring kv_transfer_params: %s", request.request_id, exc)
            return None
        if isinstance(parsed, PrefillHandoff) and parsed.push:
            # vLLM's push-mode proxy expects the PE to WRITE here; this DE pulls instead, as from any hand-off.
            logger.info("request %s: a push-mode proxy's hand-off (no blocks, no hold token): pulling request %s "
                        "from PE %s by its id", request.request_id, parsed.remote_request_id,
                        parsed.remote_side_channel)  # fmt: skip
        return parsed

    def _plan_pull(self, state: _RequestState, num_external_tokens: int) -> None:
        handoff, state.remote_prefill = state.remote_prefill, None
        request = state.request
        # vLLM would ask again after a failed pull: then it recomputes.
        request.kv_transfer_params = {**request.kv_transfer_params, "do_remote_prefill": False}
        num_prompt = len(request.prompt_token_ids or ())
        state.stored_chunks = state.saved_chunks = handoff.stored_chunks
        wanted = -(-num_prompt // self.geometry.block_size)
        # Leading blocks the local prefix cache already held are not pulled.
        first = (num_prompt - num_external_tokens) // self.geometry.block_size
        local = state.block_ids[first:wanted] if num_external_tokens else []
        if handoff.push:
            # Its blocks come with the claim: the worker takes them from ``first`` on.
            remote_blocks = None
        elif len(handoff.remote_block_ids) < wanted:
            # The worker reports every local block failed: vLLM recomputes.
            logger.warning("request %s: PE sent %d blocks for %d prompt tokens", request.request_id,
                           len(handoff.remote_block_ids), num_prompt)  # fmt: skip
            remote_blocks = []
        else:
            remote_blocks = handoff.remote_block_ids[first:wanted] if local else []
        kept = self._kept_chunks(state, handoff, first) if local and remote_blocks else []
        self._pulls.append(
            PullSpec(
                req_id=request.request_id,
                remote_side_channel=handoff.remote_side_channel,
                remote_req_id=handoff.remote_request_id,
                remote_hold_token=handoff.hold_token,
                remote_block_ids=remote_blocks,
                block_ids=local,
                remote_first_block=first,
                kept_token=handoff.kept_token if kept else None,
                kept=kept,
            )
        )

    def _retained_hit(self, state: _RequestState, num_computed_tokens: int) -> int:
        """PE: the tokens to pull from the DE that decoded the conversation's last turn (:class:`RetainedDecode`
        in the request's params), past those computed here; 0 if none match: then the store is asked."""
        state.retained_asked = True
        request = state.request
        retained = state.retained or self._parsed(request, RetainedDecode)
        if retained is None:
            return 0
        chunk_tokens = self.geometry.chunk_tokens
        if state.retained is None:
            # Never the last prompt token (vLLM computes it to sample), and only chunks whose hash chain is this
            # prompt's: the same tokens, model, salt and adapter as the KV the DE holds.
            usable = min(retained.retained_tokens, request.num_tokens - 1) // chunk_tokens
            own = self._hashes(state, usable * chunk_tokens)
            state.retained_chunks = next((n for n, digest in retained.checkpoints if n <= len(own) and own[n - 1] == digest), 0)
            if retained.tp_size != self.tp_size:
                logger.info("request %s: the retained decode of a DE at TP %d (here %d) is not pulled",
                            request.request_id, retained.tp_size, self.tp_size)  # fmt: skip
                return 0
            if len(retained.remote_block_ids) * self.geometry.block_size < state.retained_chunks * chunk_tokens:
                state.retained_chunks = 0
        tokens = state.retained_chunks * chunk_tokens - num_computed_tokens
        if tokens <= 0:
            # Nothing to pull (another conversation's turn, or all here already): the DE's hold ends now.
            logger.info("request %s: the DE's retained decode %s is not pulled (%d of its chunks match, %d tokens "
                        "computed here)", request.request_id, retained.remote_request_id, state.retained_chunks,
                        num_computed_tokens)  # fmt: skip
            self._pulls.append(PullSpec(request.request_id, retained.remote_side_channel, retained.remote_request_id,
                                        retained.hold_token, [], []))  # fmt: skip
            state.retained = None
            return 0
        state.retained = retained
        # The last turn's PE and DE saved these chunks: saving starts after them.
        state.stored_chunks = max(state.stored_chunks, state.retained_chunks)
        state.saved_chunks = max(state.saved_chunks, state.retained_chunks)
        return tokens

    def _plan_retained_pull(self, state: _RequestState, num_external_tokens: int) -> None:
        retained, state.retained = state.retained, None
        end = state.retained_chunks * self.geometry.chunk_tokens
        first = (end - num_external_tokens) // self.geometry.block_size
        wanted = end // self.geometry.block_size
        local = state.block_ids[first:wanted] if num_external_tokens else []
        self._pulls.append(PullSpec(state.request.request_id, retained.remote_side_channel, retained.remote_request_id,
                                    retained.hold_token, retained.remote_block_ids[first:wanted] if local else [], local))
        logger.debug("request %s: pulling %d tokens of the conversation from DE %s", state.request.request_id,
                     num_external_tokens, retained.remote_side_channel)  # fmt: skip

    def _kept_chunks(self, state: _RequestState, handoff: PrefillHandoff, first_block: int) -> list[ChunkLoad]:
        """The hand-off's kept chunks as loads into this request's blocks from ``first_block`` on.

        Hashes come from the prompt here, not from the hand-off: the worker
        uses a kept chunk only if the DE's buffer holds exactly that hash.
        """
        if handoff.kept_token is None:
            return []
        num_prompt = len(state.request.prompt_token_ids or ())
        hashes = self._hashes(state, num_prompt)
        bpc = self.geometry.blocks_per_chunk
        end = min(handoff.kept_first_chunk + handoff.kept_chunks, len(hashes))
        chunks = []
        for chunk in range(handoff.kept_first_chunk, end):
            skip = max(0, first_block - chunk * bpc)
            if skip < bpc:
                blocks = state.block_ids[chunk * bpc + skip : (chunk + 1) * bpc]
                chunks.append(ChunkLoad(chunk_hash=hashes[chunk], first_sub_block=skip, block_ids=blocks))
        return chunks

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DualPathMetadata:
        meta = DualPathMetadata(loads=self._loads, pulls=self._pulls, sends=self._sends, dropped_req_ids=self._dropped,
                                computed_tokens=sum(scheduler_output.num_scheduled_tokens.values()))  # fmt: skip
        self._loads, self._pulls, self._sends, self._dropped = [], [], [], []
        self._engine_busy = bool(scheduler_output.num_scheduled_tokens)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None or not self._cacheable(state.request):
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan_save(state, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None or not self._cacheable(state.request):
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            computed_after = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            self._plan_save(state, computed_after, meta)
        return meta

    def update_connector_output(self, invalid_block_ids: set[int] | None) -> None:
        """After vLLM handled the step's load errors: chunks whose blocks failed are not known stored any more.

        A load that fails mid-forward (a layer arriving late or bad) is
        recomputed by a running request that vLLM never asks about again, so
        the save plan and the lookup cache are corrected here: the chunks from
        the first failed one on are saved again as they are recomputed, and
        the store is asked afresh about them.
        """
        if not invalid_block_ids:
            return
        bpc = self.geometry.blocks_per_chunk
        for state in self._states.values():
            failed = [i for i, block in enumerate(state.block_ids) if block in invalid_block_ids]
            if not failed:
                continue
            first = failed[0] // bpc
            state.resave_until = max(state.resave_until, state.saved_chunks)
            state.saved_chunks = min(state.saved_chunks, first)
            state.stored_chunks = min(state.stored_chunks, first)
            self._present.forget(self._lookup_keys.object_keys(state.hashes[first:]))

    def saves_finished(self, saved: SavedChunks | None) -> None:
        """The workers' finished writes this step (vLLM's worker metadata): durable chunks are announced."""
        if not isinstance(saved, SavedChunks):
            return
        if saved.writes:
            self._writes_in_flight = max(0, self._writes_in_flight - saved.writes)
            self._writes_drain_until = self._clock() + WRITES_DRAIN_GIVE_UP_S
        if self.events is not None:
            self.events.saved(saved)

    def has_pending_push_work(self) -> bool:
        """Whether writes are still in flight: a serving engine (vLLM's busy loop) keeps stepping, empty steps
        included, so a write ending after the last request still reaches /metrics and the KV events."""
        return self._writes_in_flight > 0 and self._clock() < self._writes_drain_until

    def take_events(self) -> list[KVCacheEvent]:
        """The store's KV events since the last step (vLLM publishes them with its own)."""
        if self.events is None:
            return []
        if self.removal_watcher is not None:
            removed = self.removal_watcher.take_removed()
            # Gone from the store: the lookup cache must not call them present either.
            self._present.forget(self._lookup_keys.object_keys(removed))
            self.events.removed(removed)
        return self.events.take()

    def get_stats(self) -> DualPathStats | None:
        data = self.stats.take()
        return DualPathStats(data=data) if data is not None else None

    def _plan_save(self, state: _RequestState, computed_after_step: int, meta: DualPathMetadata) -> None:
        # A PE saves the prompt chunks it computes through its own storage
        # link; its hand-off tells the DE to save only from there on (the
        # chunks decoding completes), so saves use both links, none twice.
        # Only tokens that exist (not async-scheduling placeholders) are hashed.
        complete = min(computed_after_step, len(state.request.all_token_ids)) // self.geometry.chunk_tokens
        if complete <= state.saved_chunks:
            return
        bpc = self.geometry.blocks_per_chunk
        if len(state.block_ids) < complete * bpc:
            logger.warning("request %s: fewer blocks than computed tokens; not saving", state.request.request_id)
            return
        hashes = self._hashes(state, complete * self.geometry.chunk_tokens)
        first = state.saved_chunks
        # Soon stored: a lookup must not be answered "absent" from memory for them.
        self._present.forget(self._lookup_keys.object_keys(hashes[first:complete]))
        meta.saves.append(
            SaveSpec(
                req_id=state.request.request_id,
                chunk_hashes=hashes[first:complete],
                block_ids=[state.block_ids[c * bpc : (c + 1) * bpc] for c in range(first, complete)],
                only_missing=first < state.resave_until,
            )
        )
        state.saved_chunks = complete
        self._writes_in_flight += self._lookup_keys.keys_per_chunk
        self._writes_drain_until = self._clock() + WRITES_DRAIN_GIVE_UP_S
        if self.events is not None:
            self.events.planned(state.request, first, hashes[first:complete])

    def _log_lookup_error(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_lookup_error_log > 10.0:
            self._last_lookup_error_log = now
            logger.warning("store lookup failed, serving without hits: %s", exc)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their blocks out of the KV cache in the step that computed
        # them, and vLLM itself keeps blocks of an in-flight load until it is
        # reported: only a PE's hand-off to its DE holds blocks longer.
        from vllm.v1.request import RequestStatus

        state = self._states.pop(request.request_id, None)
        self._pending_hit_chunks.pop(request.request_id, None)
        self._lookups.drop(request.request_id)
        self._dropped.append(request.request_id)
        if state is None:
            return False, None
        if state.remote_prefill is not None or state.retained is not None:
            # Aborted before its pull was planned: the peer still holds blocks.
            held = state.remote_prefill or state.retained
            self._pulls.append(PullSpec(request.request_id, held.remote_side_channel, held.remote_request_id,
                                        held.hold_token, [], []))  # fmt: skip
            return False, None
        prefilled = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if self.kv_role == "kv_consumer" and self.config.pd_retain_decode_s > 0 and prefilled and block_ids:
            return self._retain(state, block_ids)
        if not (state.remote_decode is not None and prefilled and block_ids):
            return False, None
        hold_token = new_hold_token()
        self._sends.append(SendSpec(request.request_id, time.time() + self.config.pd_lease_s, hold_token, list(block_ids)))
        kept_token, kept_first_chunk, kept_chunks = state.kept or (None, 0, 0)
        return True, PrefillHandoff(
            remote_side_channel=f"{self.config.side_channel_host}:{self.config.side_channel_port}",
            remote_request_id=request.request_id,
            remote_block_ids=list(block_ids),
            hold_token=hold_token,
            tp_size=self.tp_size,
            # Stored, or being saved by this engine.
            stored_chunks=state.saved_chunks,
            kept_token=kept_token,
            kept_first_chunk=kept_first_chunk,
            kept_chunks=kept_chunks,
        ).to_dict()

    def _retain(self, state: _RequestState, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """DE: hold a finished decode's blocks for the conversation's next prefill (:class:`RetainedDecode`)."""
        request = state.request
        # The KV the blocks hold: every token but the last sampled one, which was never fed back (never more).
        retained = min(request.num_computed_tokens, request.num_tokens - 1)
        chunks = retained // self.geometry.chunk_tokens
        if chunks == 0 or not self._cacheable(request):
            return False, None
        hashes = self._hashes(state, chunks * self.geometry.chunk_tokens)
        hold_token = new_hold_token()
        self._sends.append(SendSpec(request.request_id, time.time() + self.config.pd_retain_decode_s, hold_token,
                                    list(block_ids), retained=True))  # fmt: skip
        return True, RetainedDecode(
            remote_side_channel=f"{self.config.side_channel_host}:{self.config.side_channel_port}",
            remote_request_id=request.request_id,
            remote_block_ids=list(block_ids),
            hold_token=hold_token,
            retained_tokens=retained,
            checkpoints=[(n, hashes[n - 1]) for n in range(chunks, max(0, chunks - RETAINED_CHECKPOINTS), -1)],
            tp_size=self.tp_size,
        ).to_dict()

    def shutdown(self) -> None:
        self._lookups.close()
        if self.removal_watcher is not None:
            self.removal_watcher.close()
            self.removal_watcher.store.close()
        self.store.close()
