"""The connector's configuration (``kv_connector_extra_config``), validated once at start-up.

Unknown or bad keys fail engine start-up with a message naming the key, e.g.
``kv_connector_extra_config: unknown key 'chunk_token'``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from nixl_backends.configuration import ConfigError, from_dict, refuse_secret
from nixl_backends.integrity import DEFAULT_INTEGRITY, integrity_key_from_env, integrity_tag
from nixl_backends.layout import KVNamespace
from nixl_backends.registry import parse_store_config
from nixl_backends.traffic_isolation import UcxTraffic, parse_traffic

from dualpath_connector.load.plan import DE_READ_TIMEOUT_S, SPLIT_READ_MIN_TOKENS

_WHERE = "kv_connector_extra_config."
# Where the transport section's keys are named in errors (also those found at the UCX backend's creation).
TRANSPORT_WHERE = f"{_WHERE}transport."
LOAD_MODES = ("layerwise", "bulk")
# vLLM's Locality values (vllm.v1.kv_offload.base.Locality) for kv_events_locality.
KV_EVENT_LOCALITIES = ("LOCAL", "REMOTE")
# vLLM's physical KV cache layouts (vllm.v1.kv_cache_layout.KVCacheLayout) whose
# blocks this connector copies: each layer's block is one run of bytes (or, for
# LHBNC, one run per head). BHLNC interleaves layers inside a head and is not.
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC")
# vLLM's legacy names (VLLM_KV_CACHE_LAYOUT accepts them).
_LAYOUT_ALIASES = {"HND": "LBHNC", "NHD": "LBNHC"}
# kv_producer: prefill engine (PE); kv_consumer: decode engine (DE).
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass
class DualPathConfig:
    # The store section, e.g. {"backend": "s3", "endpoint": ..., "bucket": ...}.
    store: dict[str, Any]
    # First path component of every key: <key_prefix>/<namespace>/<hh>/<hash>.
    key_prefix: str = "dualpath"
    # Tokens per stored chunk; a multiple of vLLM's block_size (default: one block).
    chunk_tokens: int | None = None
    # Host buffer slots (one Full Block each) for loads; also caps one request's hit.
    load_buffer_chunks: int = 1024
    # Host buffer slots for chunks copied out of the KV cache and waiting to be written.
    save_buffer_chunks: int = 256
    # Chunks remembered as present in the store (they are immutable, so a
    # positive answer stays true); saves a store round trip per lookup.
    lookup_cache_chunks: int = 100_000
    # A remembered "present" is asked about again after this long (a chunk deleted by gc or a lifecycle rule;
    # a load that finds one missing forgets it at once).
    lookup_cache_ttl_s: float = 600.0
    # A lookup's first absent chunk is remembered as absent this long: vLLM asks again every step about a
    # request it cannot schedule yet, and a burst of requests with one prefix asks the store once. Short,
    # because another engine may save that chunk any moment (this engine forgets it when it saves it).
    lookup_absent_ttl_s: float = 1.0
    # Store lookups on their own thread, vLLM's scheduler answered "ask again" meanwhile (a store with
    # milliseconds per request would otherwise stall every running decode); false: on the scheduler thread
    # (a local POSIX store answers in microseconds, and the request is scheduled one step sooner).
    lookup_in_background: bool = True
    # Names the model in the namespace; set it when engines load the same
    # weights from different paths (default: vLLM's --model value).
    model_id: str | None = None
    # "layerwise": a hit's Layer Blocks land in the KV cache layer by layer,
    # just before each attention layer of the next forward; "bulk": the whole
    # hit lands before the load is reported.
    load_mode: str = "layerwise"
    # Layerwise with a store that delivers per layer (s3agg): the longest the
    # forward waits for one layer of a hit still arriving; chunks whose layer
    # is later are reported to vLLM as load errors and recomputed.
    layer_arrival_timeout_s: float = 10.0
    # PD roles (kv_producer / kv_consumer): where this engine's side channel
    # listens for its peers (agent metadata, DE-side read requests).
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int | None = None
    # How long one side keeps memory for the other: a PE's prompt blocks
    # awaiting the DE's pull, a DE's host buffer awaiting the PE's pull.
    pd_lease_s: float = 120.0
    # DE: how long a finished decode's blocks are held for the conversation's next prefill to pull (vLLM's
    # multi-turn P/D proxy hands the DE's answer to the next turn's PE: RetainedDecode); 0: not held (the next
    # turn's hit comes from the store). Off by default: a front door that does not hand the answer on would
    # leave every decode's blocks held this long.
    pd_retain_decode_s: float = 0.0
    # A PE waits this long for a DE to read a hit into its buffer, then reads
    # the store itself.
    de_read_timeout_s: float = DE_READ_TIMEOUT_S
    # Deadline of one NIXL transfer between engines, and of the store read that replaces a READ failing
    # mid-forward (the step fails past it instead of waiting without end).
    pd_transfer_timeout_s: float = 30.0
    # PE: a hit it would read behind its own queued reads is offered to the
    # request's DE, which reads it only if it can finish sooner (work stealing
    # between the two storage links; the DE keeps what it read for its decode).
    move_queued_reads: bool = True
    # PE, with move_queued_reads: a hit long enough to give each side at least
    # this many tokens is split so that the DE reads its tail while this engine
    # reads the head, both links at once (load/plan.py); 0: never split.
    split_read_min_tokens: int = SPLIT_READ_MIN_TOKENS
    # PE, with move_queued_reads: the least deadline a DE is given for a read moved or split to it (at most
    # de_read_timeout_s). The deadline offered is the time the whole read would take here at this engine's
    # measured store rate, which counts neither the side channel's round trip nor the DE's scheduling, and
    # assumes the two links independent: where a read takes milliseconds, or both links are one server (one
    # machine), the DE's answer can miss it and the PE reads that part too. 0: the estimate alone.
    moved_read_min_deadline_s: float = 0.0
    # Store reads this engine runs at once (its own hits, and a DE's reads for PEs), each with the store's
    # own window of requests in flight: while one read verifies its chunks or waits for its last object,
    # the next keeps the storage link busy. 1: one read after another.
    store_reads_in_flight: int = 2
    # A load's failed store requests are sent again (store.io_retries) only until the hit's estimated recompute
    # time from the load's start has passed (recompute_time.py): past it, recomputing is sooner. False: retry as
    # store.io_retries allows, whatever it costs the forward (a deployment that prefers loads to recomputes).
    retries_within_recompute: bool = True
    # A directory for per-read timestamps (queued, started, finished), one
    # JSON-lines file per engine process (read_timeline.py); unset: none.
    read_timeline_dir: str | None = None
    # Benchmarks only (dualpath-bench's Oracle): hits count as loaded
    # without a byte read or moved, so outputs are wrong. Refused unless the
    # environment says DUALPATH_BENCHMARK=1.
    benchmark_oracle: bool = False
    # How stored chunks are verified before their bytes reach the KV cache:
    # "keyed" (a BLAKE3 MAC under $DUALPATH_INTEGRITY_KEY, shared by the
    # deployment's engines: a writer without the key cannot poison the cache)
    # or "checksum" (XXH3 per Layer Block: corruption and truncation only;
    # warned about at start-up).
    integrity: str = DEFAULT_INTEGRITY
    # The physical KV cache layout this connector asks vLLM for (one of
    # KV_CACHE_LAYOUTS); VLLM_KV_CACHE_LAYOUT overrides it, as it overrides any
    # connector's wish. It is part of the namespace, so engines whose blocks
    # order their bytes differently never share chunks. An attention backend
    # that cannot use it fails start-up, naming the layouts it can.
    kv_cache_layout: str = "LBHNC"
    # vLLM KV events for the store (BlockStored/BlockRemoved, medium "STORAGE"):
    # None follows vLLM's --kv-events-config (enable_kv_cache_events); false
    # keeps vLLM's own GPU-tier events only; true requires them enabled.
    kv_events: bool | None = None
    # Events queued between two engine steps at most; more are dropped (counted).
    kv_events_max_queued: int = 10_000
    # How often the scheduler looks for `dualpath-kv gc` removal records, to
    # announce BlockRemoved for the chunks gc deleted; 0: never.
    kv_events_gc_poll_s: float = 10.0
    # vLLM's events carry every stored block's token ids (and a salted prompt's salt): a publisher bound to every
    # interface (vLLM's default endpoint tcp://*:5557) stops start-up unless this is true.
    kv_events_public_bind: bool = False
    # false: the store's BlockStored events carry no token ids (consumers that recompute block keys from them,
    # llm-d's precise prefix-cache scorer, then cannot use them).
    kv_events_token_ids: bool = True
    # The store's events' locality, as vLLM's own storage tiers set it (routers such as Dynamo's tell a tier
    # the engine reads itself from a shared one by it): "LOCAL" or "REMOTE"; None: the store's own (posix and
    # dualblade LOCAL, s3 and s3agg REMOTE, tiered REMOTE when a tier is). A posix root every engine mounts
    # (3FS, Lustre, NFS) is "REMOTE".
    kv_events_locality: str | None = None
    # PD roles: UCX settings for KV transfers between engines, e.g. {"ucx_ib_sl": 3} to keep them in
    # their own InfiniBand service level (docs/traffic-isolation.md); unset: UCX's defaults.
    transport: dict[str, Any] | None = None
    # Parsed from `store` by validate(); not a user key.
    store_config: Any = field(default=None, init=False, repr=False)
    # Parsed from `transport` by validate(); not a user key.
    transport_config: UcxTraffic = field(default_factory=UcxTraffic, init=False, repr=False)
    # Derived from `integrity` and the environment by validate(); never logged.
    integrity_key: bytes | None = field(default=None, init=False, repr=False)

    def validate(self) -> None:
        # vLLM logs kv_connector_extra_config verbatim at start-up.
        refuse_secret(self.store, f"{_WHERE}store", "vLLM's start-up log")
        self.store_config = parse_store_config(self.store, f"{_WHERE}store.")
        self.integrity_key = integrity_key_from_env(self.integrity, _WHERE)
        self.transport_config = parse_traffic(self.transport, TRANSPORT_WHERE)
        if self.chunk_tokens is not None and self.chunk_tokens <= 0:
            raise ConfigError(f"{_WHERE}chunk_tokens must be positive, got {self.chunk_tokens}")
        for name in ("load_buffer_chunks", "save_buffer_chunks", "lookup_cache_chunks", "kv_events_max_queued",
                     "store_reads_in_flight"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_WHERE}{name} must be positive, got {getattr(self, name)}")
        if self.split_read_min_tokens < 0:
            raise ConfigError(f"{_WHERE}split_read_min_tokens must not be negative, got {self.split_read_min_tokens}")
        if not 0 <= self.moved_read_min_deadline_s <= self.de_read_timeout_s:
            raise ConfigError(f"{_WHERE}moved_read_min_deadline_s must be between 0 and de_read_timeout_s "
                              f"({self.de_read_timeout_s}), got {self.moved_read_min_deadline_s}")
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"bad value for {_WHERE}'load_mode': {self.load_mode!r}; supported: {LOAD_MODES}")
        for name in ("pd_lease_s", "de_read_timeout_s", "pd_transfer_timeout_s", "layer_arrival_timeout_s",
                     "lookup_cache_ttl_s", "lookup_absent_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_WHERE}{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.pd_retain_decode_s <= 3600:
            raise ConfigError(f"{_WHERE}pd_retain_decode_s must be 0 (off) to 3600 seconds, got {self.pd_retain_decode_s}")
        if self.pd_lease_s <= self.de_read_timeout_s + self.pd_transfer_timeout_s:
            # A lease must outlive the peer's own deadlines, or memory could be
            # reused under a transfer the peer still counts on.
            raise ConfigError(
                f"{_WHERE}pd_lease_s ({self.pd_lease_s}) must exceed de_read_timeout_s + pd_transfer_timeout_s"
            )
        if self.benchmark_oracle and os.environ.get("DUALPATH_BENCHMARK") != "1":
            raise ConfigError(
                f"{_WHERE}benchmark_oracle skips every KV read, so outputs are wrong; it is for "
                "benchmarks only and needs DUALPATH_BENCHMARK=1 in the environment"
            )
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ConfigError(
                f"bad value for {_WHERE}'kv_cache_layout': {self.kv_cache_layout!r}; supported: {KV_CACHE_LAYOUTS}"
            )
        if self.kv_events_gc_poll_s < 0:
            raise ConfigError(f"{_WHERE}kv_events_gc_poll_s must not be negative, got {self.kv_events_gc_poll_s}")
        if self.kv_events_locality is None:
            self.kv_events_locality = self.store_config.locality
        elif self.kv_events_locality not in KV_EVENT_LOCALITIES:
            raise ConfigError(f"bad value for {_WHERE}'kv_events_locality': {self.kv_events_locality!r}; "
                              f"choose one of {KV_EVENT_LOCALITIES}")
        if self.side_channel_port is not None and not 0 < self.side_channel_port < 65536:
            raise ConfigError(f"{_WHERE}side_channel_port must be a TCP port, got {self.side_channel_port}")

    def validate_role(self, kv_role: str) -> None:
        if kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role {kv_role!r} is not supported by DualPathConnector; supported: {KV_ROLES}")
        if kv_role != "kv_both" and self.side_channel_port is None:
            raise ConfigError(f"{_WHERE}side_channel_port is required with kv_role {kv_role!r}")
        if kv_role == "kv_both" and self.transport:
            # Only PD roles create the UCX backend these settings are for; silently ignoring them would mislead.
            raise ConfigError(f"{_WHERE}transport applies to KV transfers between engines: kv_producer or "
                              f"kv_consumer, not kv_role {kv_role!r}")  # fmt: skip


def parse_config(extra_config: dict[str, Any] | None, kv_role: str = "kv_both") -> DualPathConfig:
    if not extra_config or "store" not in (extra_config or {}):
        raise ConfigError(f"missing required key {_WHERE}'store' (e.g. {{\"backend\": \"posix\", \"root\": ...}})")
    config = from_dict(DualPathConfig, extra_config, _WHERE)
    config.validate_role(kv_role)
    return config


def waits_per_layer(extra_config: dict[str, Any] | None) -> bool:
    """Whether a forward waits inside itself, layer by layer, for KV: layerwise loads and the DE-side READs
    that land in the forward do, bulk loads land before the forward. vLLM replays a full CUDA graph without
    calling ``wait_for_layer_load``, so attention could read blocks before their KV arrived. Read before
    the configuration is validated (vLLM asks while it resolves its own config), so an unknown mode
    counts as waiting; the connector refuses it at start-up anyway."""
    return (extra_config or {}).get("load_mode", DualPathConfig.load_mode) != "bulk"


def resolve_chunk_tokens(config: DualPathConfig, block_size: int) -> int:
    chunk_tokens = config.chunk_tokens or block_size
    if chunk_tokens % block_size:
        raise ConfigError(
            f"{_WHERE}chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block_size ({block_size})"
        )
    return chunk_tokens


@dataclass(frozen=True)
class ChunkGeometry:
    """How stored chunks map onto vLLM blocks; the scheduler and worker halves share it."""

    block_size: int
    chunk_tokens: int

    @classmethod
    def of(cls, config: DualPathConfig, vllm_config: Any) -> ChunkGeometry:
        block_size = vllm_config.cache_config.block_size
        return cls(block_size, resolve_chunk_tokens(config, block_size))

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size


def check_parallel(parallel: Any, config: DualPathConfig, kv_role: str) -> None:
    """Refuse, at start-up, the parallel shapes this connector cannot serve; ``parallel`` is vLLM's ParallelConfig.

    Tensor parallel works in every role: each rank stores and loads its own
    shard, and in PD rank ``r`` serves its side channel at
    ``side_channel_port + r`` and talks to rank ``r`` of its peers.
    """
    if parallel.pipeline_parallel_size > 1:
        # vLLM 0.32's CPU build, the only one tests run, crashes on the first request at PP=2 (an
        # AssertionError in the second stage's worker), so per-stage saves and loads were never run end to end.
        raise ConfigError(
            f"DualPathConnector does not support pipeline parallel size {parallel.pipeline_parallel_size} "
            "(per-stage saves and loads are untested); run it with pipeline_parallel_size 1"
        )
    last_port = (config.side_channel_port or 0) + parallel.tensor_parallel_size - 1
    if kv_role != "kv_both" and last_port >= 65536:
        raise ConfigError(
            f"{_WHERE}side_channel_port {config.side_channel_port}: TP rank {parallel.tensor_parallel_size - 1} "
            f"would serve at port {last_port} (side_channel_port + rank), past 65535"
        )


def kv_events_enabled(vllm_config: Any, config: DualPathConfig) -> bool:
    """Whether this engine announces the store's blocks as vLLM KV events: ``kv_events``, by default vLLM's setting."""
    events_config = vllm_config.kv_events_config
    vllm_publishes = bool(events_config is not None and events_config.enable_kv_cache_events)
    if config.kv_events is None:
        enabled = vllm_publishes
    elif config.kv_events and not vllm_publishes:
        raise ConfigError(
            f"{_WHERE}kv_events is true but vLLM publishes no KV events: start the engine with "
            '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", ...}\''
        )
    else:
        enabled = config.kv_events
    if enabled and events_config.publisher == "zmq" and not config.kv_events_public_bind:
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(events_config, name, None) or ""
            if _binds_every_interface(endpoint):
                raise ConfigError(
                    f"--kv-events-config {name} {endpoint} binds every interface, and the events carry every "
                    "stored block's token ids: bind one address (tcp://127.0.0.1:5557, or the pod's IP the "
                    f"KV-event router subscribes at), or set {_WHERE}kv_events_public_bind: true"
                )
    return enabled


def _binds_every_interface(endpoint: str) -> bool:
    """A zmq endpoint this process binds on every interface (``tcp://*``, the unspecified addresses)."""
    if not endpoint.startswith("tcp://"):
        return False  # ipc:// or inproc://: local only; a connect-style endpoint binds nothing
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("*", "0.0.0.0", "::", "")


def expected_kv_cache_layout(config: DualPathConfig) -> str:
    """The layout vLLM resolves when it honours this connector: ``VLLM_KV_CACHE_LAYOUT`` first, as vLLM does.

    Every process computes it from configuration alone (the API server never
    sees the resolved one), so all name the same namespace.
    """
    requested = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if not requested:
        return config.kv_cache_layout
    layout = _LAYOUT_ALIASES.get(requested, requested)
    if layout not in KV_CACHE_LAYOUTS:
        raise ConfigError(f"VLLM_KV_CACHE_LAYOUT={requested} is not a layout DualPathConnector copies; supported: {KV_CACHE_LAYOUTS}")
    return layout


def check_resolved_layout(vllm_config: Any, config: DualPathConfig) -> None:
    """Fail start-up if vLLM resolved another layout than the namespace names (it drops a connector's
    wish its attention backend cannot use, with only a warning)."""
    resolved = vllm_config.cache_config.kv_cache_layout
    expected = expected_kv_cache_layout(config)
    if resolved is not None and resolved != expected:
        raise ConfigError(
            f"vLLM resolved KV cache layout {resolved}, DualPathConnector expects {expected}: the attention "
            f"backend cannot use {expected}; set {_WHERE}kv_cache_layout (or VLLM_KV_CACHE_LAYOUT) to a layout "
            f"it supports, one of {KV_CACHE_LAYOUTS}"
        )


def namespace_for(
    vllm_config: Any, config: DualPathConfig, chunk_tokens: int, tp_rank: int, pp_rank: int
) -> KVNamespace:
    """The namespace of this engine's KV bytes; scheduler, worker and API server derive the same one.

    A Layer Block is ``chunk_tokens`` tokens of one layer: K and V for every
    KV head of this TP rank, or for MLA models one latent vector per token
    (vLLM reports one KV head of the latent size), in the engine's cache dtype.
    Where vLLM has resolved the layout (scheduler, worker), it must be the one named.
    """
    check_resolved_layout(vllm_config, config)
    import torch
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    cache_dtype = model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    num_kv_heads = model.get_num_kv_heads(parallel)
    head_size = model.get_head_size()
    element_bytes = torch.empty((), dtype=cache_dtype).element_size()
    kv_vectors = 1 if model.use_mla else 2
    return KVNamespace(
        model=config.model_id or model.model,
        # fp8 formats share torch.uint8 storage: name the format itself.
        dtype=str(model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype).removeprefix("torch."),
        block_size=cache.block_size,
        chunk_tokens=chunk_tokens,
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        kv_layout=f"{expected_kv_cache_layout(config)}/{'mla' if model.use_mla else 'kv'}",
        layer_block_bytes=kv_vectors * num_kv_heads * head_size * chunk_tokens * element_bytes,
        tp_size=parallel.tensor_parallel_size,
        # An MLA latent is replicated, not sharded: every TP rank holds the same one, stored once.
        tp_rank=0 if model.use_mla else tp_rank,
        pp_size=parallel.pipeline_parallel_size,
        pp_rank=pp_rank,
        platform=f"{current_platform.device_type}/{vllm_config.attention_config.backend or 'auto'}",
        integrity=integrity_tag(config.integrity_key),
    )


def shard_namespaces(vllm_config: Any, config: DualPathConfig, chunk_tokens: int) -> list[KVNamespace]:
    """The namespaces a chunk's shards are stored under, rank 0's (the engine's) first: one per TP rank, or
    one for all ranks of an MLA model (its latent is replicated)."""
    parallel = vllm_config.parallel_config
    shards = {}
    for pp_rank in range(parallel.pipeline_parallel_size):
        for tp_rank in range(parallel.tensor_parallel_size):
            namespace = namespace_for(vllm_config, config, chunk_tokens, tp_rank, pp_rank)
            shards.setdefault(namespace.digest(), namespace)
    return list(shards.values())
