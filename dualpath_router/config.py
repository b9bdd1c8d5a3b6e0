"""The router's configuration: one dataclass tree loaded from YAML and validated once at start-up.

Any unknown, missing or bad key stops start-up with a message naming it,
e.g. ``router.yaml: bad value for prefill_engines[0].'url': ...``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml

from nixl_backends.configuration import ConfigError, from_dict
from nixl_backends.registry import parse_store_config

from dualpath_connector.protocol import ProtocolError, StoreKeySpace

from dualpath_router.credentials import DEFAULT_ENGINE_API_KEY_ENV, DEFAULT_METRICS_TOKEN_ENV, ENV_NAME

NO_VOCABULARY = (
    "the router needs the model's vocabulary size to check prompt token ids before an engine sees them: "
    "set `tokenizer` (a Hugging Face tokenizer directory), `model_config` (a Hugging Face model directory "
    "or its config.json) or `vocab_size`"
)

PolicyName = Literal["basic", "round_robin", "dualpath"]
ReadSideOverride = Literal["auto", "pe", "de"]


@dataclass
class EngineConfig:
    """One vLLM engine (OpenAI server with the DualPath connector)."""

    # Shown in the x-dualpath-*-engine headers and the router's /metrics.
    name: str
    # Base URL of its OpenAI server, e.g. http://127.0.0.1:8100.
    url: str
    # The machine whose storage NIC it reads through; engines on one node
    # share one read queue and form one DE group.
    node: str
    # host:port of its connector's side channel; required for decode engines
    # (the PE asks it to read when the read side is "de").
    side_channel: str | None = None

    def validate(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"url must look like http://host:port, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.side_channel is not None:
            host, _, port = self.side_channel.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"side_channel must be host:port, got {self.side_channel!r}")


@dataclass
class SchedulingConfig:
    """DualPath's constants (paper §6.1); alpha and beta in seconds, turned into tokens by rates."""

    # A node's read queue is "short" when it holds at most this many seconds of reading.
    alpha_s: float = 3.0
    # A PE holding more than this many seconds of prefill work is overloaded and skipped.
    beta_s: float = 5.0
    # Starting rates (tokens per second; prefill: tokens computed, hits
    # excluded), refined from measurements.
    read_tokens_per_s: float = 20_000.0
    prefill_tokens_per_s: float = 5_000.0
    # Weight of the newest completed request in the rate estimates.
    rate_ewma_weight: float = 0.2
    # DE phase 2: a DE is "high-token" above this factor times the group mean.
    de_token_threshold_factor: float = 1.05
    # How long a request may wait in the router's queue for a PE under beta.
    queue_timeout_s: float = 600.0
    # Requests waiting for a PE at most; more get 429 with Retry-After.
    max_queued_requests: int = 1024

    def validate(self) -> None:
        _require_positive(self, "alpha_s", "beta_s", "read_tokens_per_s", "prefill_tokens_per_s", "queue_timeout_s",
                          "max_queued_requests")
        if not 0 < self.rate_ewma_weight <= 1:
            raise ConfigError(f"rate_ewma_weight must be in (0, 1], got {self.rate_ewma_weight}")
        if self.de_token_threshold_factor < 1:
            raise ConfigError(f"de_token_threshold_factor must be >= 1, got {self.de_token_threshold_factor}")


@dataclass
class TimeoutsConfig:
    """Upstream HTTP timeouts, in seconds."""

    connect_s: float = 5.0
    # Whole prefill answer (the PE reads the hit and computes the rest).
    prefill_s: float = 600.0
    # Between two bytes of the DE's answer.
    decode_s: float = 600.0
    # One /metrics scrape.
    metrics_s: float = 2.0

    def validate(self) -> None:
        _require_positive(self, *(f.name for f in dataclasses.fields(self)))


@dataclass
class RouterConfig:
    prefill_engines: list[EngineConfig]
    decode_engines: list[EngineConfig]
    # Names the router answers to in the request's "model"; they must be the
    # engines' --served-model-name, the body goes through unchanged.
    served_model_names: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    # A request body above this gets 413 before it is parsed (a 128k-token prompt as JSON ids is ~1 MiB).
    max_request_bytes: int = 8 << 20
    # Connections served at once; more get 503 from the HTTP server (uvicorn's limit_concurrency), after the
    # connections that sent no complete request head made room (nixl_backends.http_head_timeout).
    max_connections: int = 1024
    # A connection whose request head is not complete this long after its first byte was awaited is closed (408).
    head_timeout_s: float = 5.0
    policy: PolicyName = "dualpath"
    # Forces every request's read side (tests, demos); "auto" lets the policy choose.
    read_side: ReadSideOverride = "auto"
    # A Hugging Face tokenizer directory; text prompts and chat need it.
    tokenizer: str | None = None
    # Where the vocabulary size comes from besides the tokenizer (one of the
    # three is required: token ids are checked before any engine sees them):
    # a Hugging Face model directory or its config.json (`vocab_size`,
    # `max_position_embeddings`), or the number itself.
    model_config: str | None = None
    vocab_size: int | None = None
    # Longer prompts get a 400; default: the model config's max_position_embeddings.
    max_prompt_tokens: int | None = None
    # The engines' --max-model-len: max_tokens above it, or a prompt as long, gets a 400 before any prefill
    # (vLLM's own rules, checked here so that no PE holds blocks for a request its DE would refuse); default:
    # the model config's max_position_embeddings, else unchecked.
    max_model_len: int | None = None
    # The environment variable holding the engines' API key (never the key itself).
    engine_api_key_env: str = DEFAULT_ENGINE_API_KEY_ENV
    # The environment variable holding the bearer token /metrics demands. Unset: /metrics answers loopback
    # clients only, since its counters (hit tokens before and after one request) tell whether a prompt's prefix
    # is stored.
    metrics_token_env: str = DEFAULT_METRICS_TOKEN_ENV
    metrics_refresh_interval_s: float = 1.0
    # Freed heap is handed back to the OS this often (glibc's malloc_trim; dualpath_router/heap.py); 0: never.
    heap_trim_interval_s: float = 60.0
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    # The connector's store section (credentials from the AWS chain only);
    # without it every hit is 0.
    store: object | None = None
    # "auto": the key space the first engine (config order) exports on its /metrics.
    namespace: StoreKeySpace | Literal["auto"] = "auto"
    # Whether answers carry `x-dualpath-hit-tokens` (benches, demos): off by default, since it tells a client
    # whether anyone stored its prompt's prefix. Lookups are per salt either way (a request's cache_salt).
    report_hit_tokens: bool = False
    # Chunks remembered as present (immutable, so a positive answer stays true).
    lookup_cache_chunks: int = 100_000
    # ... until this long after the store said so: nothing loads through the router's cache, so only this
    # stops it from calling a chunk present that gc or a lifecycle rule deleted.
    lookup_cache_ttl_s: float = 600.0

    def validate(self) -> None:
        if not self.prefill_engines or not self.decode_engines:
            raise ConfigError("prefill_engines and decode_engines each need at least one engine")
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ConfigError("served_model_names must be a non-empty list of names")
        names = [e.name for e in (*self.prefill_engines, *self.decode_engines)]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique, got {names}")
        for i, engine in enumerate(self.decode_engines):
            if engine.side_channel is None:
                raise ConfigError(f"missing required key decode_engines[{i}].'side_channel'")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        _require_positive(self, "metrics_refresh_interval_s", "lookup_cache_chunks", "lookup_cache_ttl_s")
        if self.tokenizer is None and self.model_config is None and self.vocab_size is None:
            raise ConfigError(NO_VOCABULARY)
        _require_positive(self, "max_request_bytes", "max_connections", "head_timeout_s")
        if not self.heap_trim_interval_s >= 0 or self.heap_trim_interval_s == float("inf"):
            raise ConfigError(f"heap_trim_interval_s must be a finite number >= 0 (0: never), got "
                              f"{self.heap_trim_interval_s}")  # fmt: skip
        for name in ("vocab_size", "max_prompt_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                _require_positive(self, name)
        if not ENV_NAME.fullmatch(self.metrics_token_env):
            raise ConfigError("metrics_token_env must name an environment variable (letters, digits, _) holding "
                              "the token /metrics demands, never the token itself")
        if not ENV_NAME.fullmatch(self.engine_api_key_env):
            # It may be the key itself pasted in by mistake: not shown.
            raise ConfigError("engine_api_key_env must name an environment variable (letters, digits, _) "
                              "holding the engines' API key, never the key itself")

    def engines(self) -> list[EngineConfig]:
        return [*self.prefill_engines, *self.decode_engines]


def _require_positive(section: object, *names: str) -> None:
    for name in names:
        if getattr(section, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(section, name)}")


def _section(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.')} must be a mapping, got {type(data).__name__}")
    return data


def _named(where: str, build):
    """Run ``build()``; a validate() message, which does not know where it stands, gets ``where``."""
    try:
        return build()
    except ConfigError as exc:
        if where in str(exc):
            raise
        raise ConfigError(f"{where}{exc}") from None


def _build(cls: type, data: Any, where: str) -> Any:
    return _named(where, lambda: from_dict(cls, _section(data, where), where))


def _engine_list(data: Any, where: str) -> list[EngineConfig]:
    if not isinstance(data, list):
        raise ConfigError(f"{where} must be a list of engines, got {type(data).__name__}")
    return [_build(EngineConfig, item, f"{where}[{i}].") for i, item in enumerate(data)]


def _store(data: Any, where: str) -> object:
    section = _section(data, where)
    if "secret_key" in section or "access_key" in section:
        # Configs get copied into tickets and logs; keys belong in the AWS chain.
        raise ConfigError(
            f"{where}access_key/secret_key are not accepted in the router config; "
            "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or another AWS credential source"
        )
    return _named(where, lambda: parse_store_config(section, where))


def _key_space(data: Any, where: str) -> StoreKeySpace:
    def build() -> StoreKeySpace:
        try:
            return from_dict(StoreKeySpace, _section(data, where), where)
        except ProtocolError as exc:  # StoreKeySpace.validate speaks the protocol's error
            raise ConfigError(str(exc)) from None

    return _named(where, build)


def parse_router_config(data: Any) -> RouterConfig:
    """Build and validate the tree from a parsed YAML document."""
    raw = dict(_section(data, "the router config"))
    for role in ("prefill_engines", "decode_engines"):
        if role in raw:
            raw[role] = _engine_list(raw[role], role)
    for name, cls in (("scheduling", SchedulingConfig), ("timeouts", TimeoutsConfig)):
        if name in raw:
            raw[name] = _build(cls, raw[name], f"{name}.")
    if raw.get("store") is not None:
        raw["store"] = _store(raw["store"], "store.")
    if isinstance(raw.get("namespace"), dict):
        raw["namespace"] = _key_space(raw["namespace"], "namespace.")
    return from_dict(RouterConfig, raw, "")


def load_router_config(path: str | Path) -> RouterConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the router config: {exc}") from None
    try:
        return parse_router_config(data)
    except ConfigError as exc:
        raise ConfigError(f"{path.name}: {exc}") from None
