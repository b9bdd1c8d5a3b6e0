"""Scheduler half: finds hits in the store, plans loads and saves, emits per-step metadata."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nixl_backends.layout import BlockLayout, chunk_hashes, chunk_key
from nixl_backends.registry import make_store

from dualpath_connector.config import ChunkGeometry, DualPathConfig, namespace_for
from dualpath_connector.metadata import ChunkLoad, DualPathMetadata, LoadSpec, PullSpec, SaveSpec, SendSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# After this many loads of one request failed, it is served without the store:
# the store may keep calling a chunk present that cannot be read.
MAX_LOAD_ATTEMPTS = 2


@dataclass
class _RequestState:
    request: Request
    # Hashes of the request's full chunks computed so far (extended lazily).
    hashes: list[str] = field(default_factory=list)
    # Leading chunks known to be in the store; saving starts after them.
    stored_chunks: int = 0
    # Chunks handed to the worker for saving (or known stored).
    saved_chunks: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Loads issued for this request; a second ask follows a failed load.
    loads_issued: int = 0
    # PE: the router asked for prefill only; the DE persists the chunks.
    remote_decode: bool = False
    # DE: the PE's kv_transfer_params, until the pull is planned.
    remote_prefill: dict[str, Any] | None = None


class DualPathScheduler:
    def __init__(self, vllm_config: VllmConfig, config: DualPathConfig, kv_role: str) -> None:
        self.config = config
        self.kv_role = kv_role
        self.geometry = ChunkGeometry.of(config, vllm_config)
        # The scheduler looks up rank 0's keys: every rank stores its own shard
        # of the same chunks at the same time.
        namespace = namespace_for(vllm_config, config, self.geometry.chunk_tokens, tp_rank=0, pp_rank=0)
        self.namespace_digest = namespace.digest()
        layout = BlockLayout(namespace.num_layers, namespace.layer_block_bytes)
        self.store = make_store(config.store_config, layout)  # lookup only: no NIXL agent here
        self._present: OrderedDict[str, None] = OrderedDict()
        self._states: dict[str, _RequestState] = {}
        # Hit found by get_num_new_matched_tokens, consumed by update_state_after_alloc.
        self._pending_hit_chunks: dict[str, int] = {}
        self._loads: list[LoadSpec] = []
        self._pulls: list[PullSpec] = []
        self._sends: list[SendSpec] = []
        self._dropped: list[str] = []
        self._last_lookup_error_log = 0.0
        logger.info(
            "DualPath scheduler: namespace %s, chunk %d tokens, store %s",
            self.namespace_digest,
            self.geometry.chunk_tokens,
            type(self.store).__name__,
        )

    # -- hashing and lookup ---------------------------------------------------

    def _state(self, request: Request) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _RequestState(request)
        return state

    def _hashes(self, state: _RequestState, num_tokens: int) -> list[str]:
        wanted = num_tokens // self.geometry.chunk_tokens
        have = len(state.hashes)
        if wanted > have:
            state.hashes.extend(
                chunk_hashes(
                    self.namespace_digest,
                    state.request.all_token_ids[: wanted * self.geometry.chunk_tokens],
                    self.geometry.chunk_tokens,
                    start_chunk=have,
                    previous_hash=state.hashes[-1] if have else None,
                )
            )
        return state.hashes[:wanted]

    def key(self, chunk_hash: str) -> str:
        return chunk_key(self.config.key_prefix, self.namespace_digest, chunk_hash)

    def _leading_present(self, keys: list[str]) -> int:
        known = 0
        while known < len(keys) and keys[known] in self._present:
            self._present.move_to_end(keys[known])
            known += 1
        if known == len(keys):
            return known
        found = known + self.store.lookup(keys[known:])
        for key in keys[known:found]:
            self._present[key] = None
        while len(self._present) > self.config.lookup_cache_chunks:
            self._present.popitem(last=False)
        return found

    # -- vLLM scheduler hooks -------------------------------------------------

    @staticmethod
    def _cacheable(request: Request) -> bool:
        # Token ids alone do not name these requests' KV: adapters, images,
        # salts and prompt embeddings change it behind the same ids.
        return not (
            request.lora_request
            or request.mm_features
            or getattr(request, "cache_salt", None)
            or getattr(request, "prompt_embeds", None) is not None
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if self.kv_role == "kv_consumer" and params.get("do_remote_prefill"):
            # The whole prompt was prefilled by a PE; vLLM itself recomputes
            # the last token to sample the next one.
            state = self._state(request)
            state.remote_prefill = params
            count = max(0, len(request.prompt_token_ids or ()) - num_computed_tokens)
            return count, count > 0
        if not self._cacheable(request):
            return 0, False
        state = self._state(request)
        state.remote_decode = self.kv_role == "kv_producer" and bool(params.get("do_remote_decode"))
        if state.loads_issued >= MAX_LOAD_ATTEMPTS:
            return 0, False
        # Never claim the last token: vLLM must compute it to sample the next one.
        claimable = (request.num_tokens - 1) // self.geometry.chunk_tokens
        hashes = self._hashes(state, claimable * self.geometry.chunk_tokens)
        keys = [self.key(h) for h in hashes]
        if state.loads_issued:
            # vLLM asks again after a load failed: what the cache remembers as
            # present may be what failed, so ask the store itself.
            for key in keys:
                self._present.pop(key, None)
        try:
            present = self._leading_present(keys)
        except Exception as exc:  # a store outage is a miss, never a dead scheduler
            self._log_lookup_error(exc)
            present = 0
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
            self._plan_pull(state, num_external_tokens)
            return
        hit_chunks = self._pending_hit_chunks.pop(request.request_id, 0)
        if num_external_tokens == 0 or hit_chunks == 0:
            return
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
        self._loads.append(LoadSpec(request.request_id, chunks, *self._read_side(request)))
        state.loads_issued += 1
        logger.debug("request %s: loading %d tokens from the store", request.request_id, num_external_tokens)

    def _read_side(self, request: Request) -> tuple[str, str | None]:
        """Who reads this request's hit from the store, as the router asked (PE role only)."""
        params = request.kv_transfer_params or {}
        if self.kv_role != "kv_producer" or params.get("read_side", "pe") == "pe":
            return "pe", None
        side, de = params.get("read_side"), params.get("de_side_channel")
        if side == "de" and isinstance(de, str) and de:
            return "de", de
        logger.warning("request %s: bad read side %r / de_side_channel %r; reading here", request.request_id, side, de)
        return "pe", None

    def _plan_pull(self, state: _RequestState, num_external_tokens: int) -> None:
        params, state.remote_prefill = state.remote_prefill, None
        request = state.request
        # vLLM would ask again after a failed pull: then it recomputes.
        request.kv_transfer_params = {**params, "do_remote_prefill": False}
        num_prompt = len(request.prompt_token_ids or ())
        stored = int(params.get("stored_chunks") or 0)
        state.stored_chunks = state.saved_chunks = stored
        remote_blocks = list(params.get("remote_block_ids") or ())
        wanted = -(-num_prompt // self.geometry.block_size)
        # Leading blocks the local prefix cache already held are not pulled.
        first = (num_prompt - num_external_tokens) // self.geometry.block_size
        local = state.block_ids[first:wanted] if num_external_tokens else []
        if len(remote_blocks) < wanted:
            # The worker reports every local block failed: vLLM recomputes.
            logger.warning("request %s: PE sent %d blocks for %d prompt tokens", request.request_id, len(remote_blocks), num_prompt)
            remote_blocks = []
        self._pulls.append(
            PullSpec(
                req_id=request.request_id,
                remote_side_channel=str(params.get("remote_side_channel")),
                remote_req_id=str(params.get("remote_request_id")),
                remote_block_ids=remote_blocks[first:wanted] if local else [],
                block_ids=local,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DualPathMetadata:
        meta = DualPathMetadata(loads=self._loads, pulls=self._pulls, sends=self._sends, dropped_req_ids=self._dropped)
        self._loads, self._pulls, self._sends, self._dropped = [], [], [], []
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

    def _plan_save(self, state: _RequestState, computed_after_step: int, meta: DualPathMetadata) -> None:
        if state.remote_decode:
            return  # its DE persists the chunks, with the decoded ones
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
        meta.saves.append(
            SaveSpec(
                req_id=state.request.request_id,
                chunk_hashes=hashes[first:complete],
                block_ids=[state.block_ids[c * bpc : (c + 1) * bpc] for c in range(first, complete)],
            )
        )
        state.saved_chunks = complete

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
        self._dropped.append(request.request_id)
        if state is None:
            return False, None
        if state.remote_prefill is not None:
            # Aborted before its pull was planned: the PE still holds blocks.
            self._pulls.append(
                PullSpec(request.request_id, str(state.remote_prefill.get("remote_side_channel")),
                         str(state.remote_prefill.get("remote_request_id")), [], [])
            )  # fmt: skip
            return False, None
        prefilled = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if not (state.remote_decode and prefilled and block_ids):
            return False, None
        self._sends.append(SendSpec(request.request_id, time.time() + self.config.pd_lease_s))
        return True, {
            "do_remote_prefill": True,
            "remote_side_channel": f"{self.config.side_channel_host}:{self.config.side_channel_port}",
            "remote_request_id": request.request_id,
            "remote_block_ids": list(block_ids),
            "stored_chunks": state.stored_chunks,
        }

    def shutdown(self) -> None:
        self.store.close()
