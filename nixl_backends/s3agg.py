"""Client of ``s3agg-gateway``: aggregated, layerwise reads of many chunk objects in one request.

``S3AggStore`` is a :class:`KVStore` over a plain ``s3`` store (lookups, writes
and fallback reads go straight to the bucket) plus :meth:`S3AggStore.read_layerwise`:
one signed request names every chunk; the gateway range-reads layer ``l`` of
all of them, assembles it in prefix order and WRITEs it into the caller's
buffer through NIXL (UCX), with a ``ready`` notification per layer; each layer
is handed to the caller's callback as its notification arrives. With
``delivery: http`` the layers arrive as frames of the HTTP response instead,
received straight into the caller's buffer. Every delivered layer carries the
chunks' integrity digests of that layer (the gateway never checks them): the
caller verifies, e.g. with :meth:`ChunkIntegrity.verify_layer_major`.

When the gateway cannot be reached (connection refused or broken, a 5xx, a
timeout) the layers not yet handed over are read from the bucket with plain
ranged GETs through NIXL OBJ; ``s3agg_client_fallbacks_total`` counts it and a
warning says why. Requests the gateway refuses (4xx: unknown key, bad
descriptor, credentials) are errors, not fallbacks.

A NIXL delivery is one-sided: the gateway's WRITEs land in the target without
this side taking part, also after the request was given up. So a request that
ended without the gateway's word that its WRITEs ended (its answer: a 200, a
4xx, a 5xx without ``x-s3agg-writes-may-land``) is canceled at the gateway
before anything else is read into the target; unless the gateway confirms that
no WRITE can land any more, the read raises :class:`TransferAbandoned` (the
caller retires the target), ``s3agg_client_retired_total`` counts it and a
warning says why. The exception's probe sends the cancel again: the target is
reused only once the gateway confirms (:mod:`nixl_backends.abandoned` asks at
growing intervals; ``s3agg_client_retired_released_total`` counts the targets
given back). A gateway process started since knows nothing of the request and
confirms it: the process that took it is gone, and its WRITEs with it. So a
cancel must reach the process that took the request: one gateway per address,
or a front that routes by ``x-s3agg-request-id``.

The wire protocol shared with the gateway is :mod:`nixl_backends.s3agg_protocol`.
"""

from __future__ import annotations

import collections
import ctypes
import http.client
import json
import logging
import os
import ssl
import threading
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

import numpy as np
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from prometheus_client import Counter

from nixl_backends.configuration import ConfigError, from_dict
from nixl_backends.layout import DIGEST_BYTES, BlockLayout
from nixl_backends.nixl_io import Polling, TransferAbandoned, descriptors, run_nixl_transfers
from nixl_backends.notifications import PerAgent, dispatcher_for
from nixl_backends.obj_backend import OBJ, obj_device_ids
from nixl_backends.s3 import S3Store, S3StoreConfig
from nixl_backends.s3_endpoint import s3_session
from nixl_backends.s3agg_protocol import (
    ALL_LAYERS,
    CANCEL_QUERY,
    CANCEL_STOPPED,
    EXTENSION_QUERY,
    FRAME,
    FRAME_CHUNKS,
    FRAME_END,
    FRAME_ERROR,
    FRAME_LAYER,
    LAYOUT_CHUNK_MAJOR,
    LAYOUT_LAYER_MAJOR,
    LAYOUT_STRIDED,
    MODE_CHUNKWISE,
    MODE_HEADER,
    NOTIFICATION_PREFIX,
    REQUEST_ID_HEADER,
    WRITES_MAY_LAND_HEADER,
    TargetLayout,
    descriptor_body,
    http_target,
    layer_region_bytes,
    nixl_target,
    parse_notification,
)
from nixl_backends.store import KVStore, StoreMetrics
from nixl_backends.traffic_isolation import UcxTraffic
from nixl_backends.transport import add_ucx_backend

logger = logging.getLogger(__name__)

# An HTTP-delivery frame holding a summary (FRAME_END) or an error (FRAME_ERROR): far below this.
_MAX_TEXT_FRAME_BYTES = 1 << 20

FALLBACKS = Counter("s3agg_client_fallbacks_total", "Reads served by plain S3 because the gateway was unreachable",
                    ["op"])
RETIRED = Counter("s3agg_client_retired_total",
                  "Gateway reads given up without the gateway confirming that its WRITEs into the target stopped")
RELEASED = Counter("s3agg_client_retired_released_total",
                   "Retired targets given back once the gateway confirmed that the request's WRITEs stopped")


class GatewayUnavailable(RuntimeError):
    """The gateway could not serve the request (unreachable, broken mid-request, 5xx): fall back.

    ``writes_ended``: the gateway said that no WRITE of the request can land any more (it answered, without
    ``x-s3agg-writes-may-land``), or it never got the request (connection refused).
    """

    def __init__(self, message: str, writes_ended: bool = False) -> None:
        super().__init__(message)
        self.writes_ended = writes_ended


class GatewayWritesAbandoned(TransferAbandoned):
    """The gateway did not confirm that the WRITEs of a request it was given stopped: they may still land.

    ``probe`` cancels the request again: True once the gateway confirms.
    """

    def __init__(self, request_id: str, why: str, probe: Callable[[], bool]) -> None:
        # TransferAbandoned's message counts NIXL transfers of this process; these are the gateway's.
        RuntimeError.__init__(self, f"s3agg request {request_id}: gateway WRITEs may still land ({why})")
        self.probe = probe


class GatewayRefused(RuntimeError):
    """The gateway refused the request (4xx) with an S3 error code; falling back would not help."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass
class S3AggStoreConfig:
    """``{"backend": "s3agg", "gateway": "http(s)://host:port", "s3": {<an s3 store section>}, ...}``."""

    # Where the chunks live relative to the engine (vLLM KV events' locality): the bucket behind the gateway.
    locality: ClassVar[str] = "REMOTE"

    gateway: str
    # The bucket behind the gateway, as a plain s3 store: lookups, writes, fallback.
    s3: dict = field(repr=False)
    # The CA file an https:// gateway's certificate is checked against (default: the system's trust store).
    gateway_ca_bundle: str | None = None
    delivery: Literal["nixl", "http"] = "nixl"
    # SigV4 identity for the gateway; defaults to the s3 section's keys.
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 60.0
    # For the cancel of a request given up (it waits for the gateway's WRITE in flight); past it the target is
    # retired.
    cancel_timeout_s: float = 5.0
    # Tokens per chunk, declared in descriptors (the gateway's arithmetic needs only S).
    chunk_tokens: int = 1
    # Per-layer compute window declared to the gateway's bandwidth scheduler.
    compute_window_s: float | None = None
    s3_config: S3StoreConfig = field(init=False, repr=False)

    def validate(self) -> None:
        parts = urlsplit(self.gateway)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ConfigError(f"store.gateway must be http://host:port or https://host:port, got {self.gateway!r}")
        if self.gateway_ca_bundle is not None:
            if parts.scheme != "https":
                raise ConfigError("store.gateway_ca_bundle is for an https:// gateway")
            if not os.path.isfile(self.gateway_ca_bundle):
                raise ConfigError(f"store.gateway_ca_bundle: no such file {self.gateway_ca_bundle!r}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ConfigError("store.access_key and store.secret_key must be given together")
        if self.chunk_tokens <= 0:
            raise ConfigError("store.chunk_tokens must be positive")
        if min(self.connect_timeout_s, self.request_timeout_s, self.cancel_timeout_s) <= 0:
            raise ConfigError("store.connect_timeout_s, request_timeout_s and cancel_timeout_s must be positive")
        if self.compute_window_s is not None and self.compute_window_s <= 0:
            raise ConfigError("store.compute_window_s must be positive")
        s3 = dict(self.s3)
        if s3.pop("backend", "s3") != "s3":
            raise ConfigError(f"store.s3.backend must be 's3', got {self.s3.get('backend')!r}")
        if s3.get("request_checksum_calculation") is None and _origin(str(s3.get("endpoint"))) == _origin(self.gateway):
            # PUTs through the gateway itself (the endpoint of a POSIX-backed one): by default it refuses a body
            # the signature does not cover (its allow_unsigned_payload), so the SDK signs the body.
            s3["request_checksum_calculation"] = "when_required"
        self.s3_config = from_dict(S3StoreConfig, s3, "store.s3.")


def _origin(url: str) -> tuple[str, str | None, int | None]:
    """Scheme, host (lower case) and port (the scheme's default if none) of ``url``: where its requests go."""
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # a port that is no number: validated elsewhere, matches nothing here
        port = None
    return parts.scheme, parts.hostname, port


@dataclass
class LayerwiseRead:
    """What :meth:`S3AggStore.read_layerwise` did."""

    request_id: str
    mode: str  # "layerwise" or "chunkwise" (the gateway's choice), or "fallback"
    # The gateway's error that caused the fallback, if any.
    error: str | None = None
    # What the gateway delivered, in arrival order: layer numbers, or "all" (NIXL notifications or
    # HTTP frames alike); layers read by the fallback are not among them.
    notifications: list[str] = field(default_factory=list)
    # The gateway's summary (mode, rate, per-phase timings), when it finished.
    summary: dict[str, Any] | None = None


def _host_view(addr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


class _Inbox:
    """The gateway's notifications to one agent, sorted by request id, so concurrent reads never take each other's.

    Registered with the agent's one :class:`NotificationDispatcher` (a PD worker's
    side channel reads the same agent's notifications for other prefixes).
    """

    def __init__(self, agent) -> None:
        self._notifications = dispatcher_for(agent)
        self._lock = threading.Lock()
        self._boxes: dict[str, collections.deque[str]] = {}
        self._notifications.register(NOTIFICATION_PREFIX.encode(), self._on_message)

    def open(self, request_id: str) -> None:
        with self._lock:
            self._boxes[request_id] = collections.deque()

    def close(self, request_id: str) -> None:
        with self._lock:
            self._boxes.pop(request_id, None)

    def take(self, request_id: str) -> list[str]:
        """Tokens of an open request that arrived since the last call."""
        self._notifications.poll()
        with self._lock:
            box = self._boxes.get(request_id)
            tokens = list(box) if box else []
            if box:
                box.clear()
        return tokens

    def _on_message(self, message: bytes) -> None:
        parsed = parse_notification(message)
        if parsed is None:
            return
        request_id, token = parsed
        with self._lock:
            box = self._boxes.get(request_id)
            if box is not None:
                box.append(token)
                return
        # A request that gave up (timeout, fallback) may still hear from the gateway.
        logger.debug("s3agg: notification for no open request dropped: %r", message[:64])


# One inbox per agent, shared by every S3AggStore opened on it.
_inbox_for: PerAgent[_Inbox] = PerAgent(_Inbox)


class S3AggStore(KVStore):
    delivers_layers = True  # read_layerwise
    reads_segments = True  # read_segments: the gateway's strided target
    def __init__(self, config: S3AggStoreConfig, layout: BlockLayout, agent=None) -> None:
        super().__init__(layout)
        self.config = config
        self._agent = agent
        if agent is not None and "UCX" not in agent.backends:
            # The gateway WRITEs into our buffers: UCX must exist before they are registered, listening on the
            # interface the gateway is reached through only (an engine of a PD pair has its UCX already, on the
            # side channel's interface).
            gateway = urlsplit(config.gateway)
            port = gateway.port or (443 if gateway.scheme == "https" else 80)
            add_ucx_backend(agent, UcxTraffic().reaching(gateway.hostname, port), "store.")
        self._inner = S3Store(config.s3_config, layout, agent)
        self._inbox = _inbox_for(agent) if agent is not None else None
        self._path = f"/{config.s3_config.bucket}?{EXTENSION_QUERY}"
        self._connections = GatewayConnections(config.gateway, config.connect_timeout_s,
                                               ca_bundle=config.gateway_ca_bundle)
        self._cancel_path = f"{self._path}&{CANCEL_QUERY}"
        if config.access_key is not None:
            self._credentials = Credentials(config.access_key, config.secret_key)
        elif config.s3_config.access_key is not None:
            self._credentials = Credentials(config.s3_config.access_key, config.s3_config.secret_key)
        else:
            # The chain's credentials renew themselves when temporary; each request is signed with a snapshot.
            self._credentials = s3_session(config.s3_config).get_credentials()
        if self._credentials is None:
            raise ConfigError("store: no credentials to sign gateway requests")
        logger.info("s3agg store: gateway=%s bucket=%s delivery=%s", config.gateway, config.s3_config.bucket,
                    config.delivery)

    # --- KVStore ------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        return self._inner.lookup(keys)

    def write(self, keys: Sequence[str], src_addrs: Sequence[int]) -> list[bool]:
        return self._inner.write(keys, src_addrs)

    def delete(self, keys: Sequence[str]) -> None:
        self._inner.delete(keys)

    def metrics(self) -> StoreMetrics:
        return self._inner.metrics()  # its payload requests: writes, and reads that fall back

    def read(self, keys: Sequence[str], dst_addrs: Sequence[int]) -> list[bool]:
        """Whole objects (Full Block and trailer) through the gateway in one request (chunk-major NIXL
        target), else plain S3; the caller verifies them."""
        if not keys:
            return []
        request_id = uuid.uuid4().hex
        target = _Target(self.layout, LAYOUT_CHUNK_MAJOR, [int(a) for a in dst_addrs], len(keys))
        try:
            self._nixl_request(request_id, keys, target, lambda token: None)
        except (GatewayUnavailable, GatewayRefused) as exc:
            # Per-chunk results (a missing chunk is False, not an error) come from the store.
            self._count_fallback("read", request_id, exc)
            return self._inner.read(keys, dst_addrs)
        return [True] * len(keys)

    def read_segments(self, keys: Sequence[str], segments: Sequence[np.ndarray]) -> list[bool]:
        """Whole objects into a layer-major pool's slots through the gateway (strided target), else plain S3
        into a scratch buffer placed by numpy; the caller verifies them."""
        if not keys:
            return []
        target = _strided_target(self.layout, segments)
        request_id = uuid.uuid4().hex
        try:
            self._nixl_request(request_id, keys, target, lambda token: None)
        except (GatewayUnavailable, GatewayRefused) as exc:
            self._count_fallback("read", request_id, exc)
            return self._read_scattered(keys, segments)
        return [True] * len(keys)

    def _read_scattered(self, keys: Sequence[str], segments: Sequence[np.ndarray]) -> list[bool]:
        size = self.layout.object_bytes
        scratch = np.empty((len(keys), size), dtype=np.uint8)
        registration = self._agent.register_memory([(scratch.ctypes.data, scratch.nbytes, 0, "")], "DRAM")
        try:
            ok = self._inner.read(keys, [scratch.ctypes.data + j * size for j in range(len(keys))])
        except TransferAbandoned as exc:
            # NIXL may still write the scratch buffer: it lives (in this closure) until the transfers ended.
            exc.when_ended(lambda scratch=scratch: self._agent.deregister_memory(registration))
            raise
        except BaseException:
            self._agent.deregister_memory(registration)
            raise
        self._agent.deregister_memory(registration)
        for j, pieces in enumerate(segments):
            if ok[j]:  # one memcpy per piece
                starts = np.cumsum(pieces[:, 1]) - pieces[:, 1]
                for (addr, length), start in zip(pieces.tolist(), starts.tolist()):
                    _host_view(addr, length)[:] = scratch[j, start : start + length]
        return ok

    def close(self) -> None:
        self._connections.close()
        self._inner.close()

    # --- layerwise ------------------------------------------------------------------------------

    def read_layerwise(
        self,
        keys: Sequence[str],
        regions: Sequence[int],
        on_layer: Callable[[int], None],
        *,
        layout: TargetLayout = LAYOUT_LAYER_MAJOR,
        compute_window_s: float | None = None,
        request_id: str | None = None,
        trailer_addrs: Sequence[int] | None = None,
        layer_stride: int = 0,
    ) -> LayerwiseRead:
        """Read layer ``l`` of every chunk, with its digests, into ``regions``, handing over each layer as it lands.

        ``regions`` are NIXL-registered DRAM addresses, per ``layout``:

        - ``layer_major``: ``num_layers`` regions of ``n*S + n*D`` bytes (``n =
          len(keys)``, ``D = DIGEST_BYTES``, :func:`~nixl_backends.s3agg_protocol.layer_region_bytes`):
          chunk ``j``'s Layer Block at ``j*S``, its stored digest of layer ``l`` at ``n*S + j*D``;
        - ``chunk_major``: ``n`` regions of ``object_bytes``, each laid out as the
          stored object (layer ``l`` at ``l*S``, its digest at ``L*S + l*D``), e.g.
          a pool slot per chunk;
        - ``strided``: ``n`` layer-0 addresses, with ``trailer_addrs`` and
          ``layer_stride``: layer ``l`` of chunk ``j`` at ``regions[j] + l*layer_stride``,
          its digest at ``trailer_addrs[j] + l*D`` (a layer-major pool's slots).

        ``on_layer(l)`` is called on this thread once per layer, in layer order,
        as soon as layer ``l``'s bytes and digests are in place. Nothing here
        verifies them (the gateway does not either): before using layer ``l`` the
        caller checks it (``ChunkIntegrity.verify_layer_major`` or
        ``verify_layer``), which says how many leading chunks are intact. If the
        gateway fails, the remaining layers come from plain S3 in the same layout
        and the callback contract still holds. Raises :class:`GatewayRefused` for
        a request the gateway rejects, :class:`TransferAbandoned` if the gateway
        may still WRITE into ``regions`` (a request given up that it did not
        confirm stopped: retire them), or an error if the fallback fails too.
        """
        if self._agent is None:
            raise RuntimeError("S3AggStore was opened without a NIXL agent: lookup only")
        target = _Target(self.layout, layout, [int(a) for a in regions], len(keys),
                         None if trailer_addrs is None else [int(a) for a in trailer_addrs], layer_stride)
        num_layers = self.layout.num_layers
        request_id = request_id or uuid.uuid4().hex
        result = LayerwiseRead(request_id, "")
        next_layer = 0

        def hand_over(token: str) -> None:
            nonlocal next_layer
            if token != ALL_LAYERS and not (token.isdigit() and int(token) < num_layers):
                raise GatewayUnavailable(f"gateway sent a notification naming no layer: {token[:32]!r}")
            result.notifications.append(token)
            upto = num_layers if token == ALL_LAYERS else int(token) + 1
            while next_layer < upto:  # in order, once each
                on_layer(next_layer)
                next_layer += 1

        window = compute_window_s or self.config.compute_window_s
        try:
            if self.config.delivery == "http":
                result.mode, result.summary = self._http_request(request_id, keys, target, hand_over, window)
            else:
                result.mode, result.summary = self._nixl_request(request_id, keys, target, hand_over, window)
        except GatewayUnavailable as exc:
            self._count_fallback("read_layerwise", request_id, exc)
            result.mode, result.error = "fallback", str(exc)
            if self._inner.lookup(keys) < len(keys):
                raise RuntimeError("s3agg fallback: a chunk is missing or short in the bucket") from None
            self._read_ranges(keys, target, on_layer, start=next_layer)
        return result

    # --- the gateway request ----------------------------------------------------------------------

    def _descriptor(self, keys: Sequence[str], target: dict[str, Any], window: float | None) -> bytes:
        return descriptor_body(keys, self.layout.num_layers, self.config.chunk_tokens,
                               self.layout.layer_block_bytes, target, window)

    def _post(self, request_id: str, body: bytes) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the signed request; returns the open response of a 200, raises otherwise."""
        try:
            conn, response = post_signed(self.config.gateway, self._path, body, self._credentials,
                                         self.config.s3_config.region, request_id,
                                         self.config.connect_timeout_s, self.config.request_timeout_s,
                                         self._connections)  # fmt: skip
        except (OSError, http.client.HTTPException) as exc:
            # Not connected (refused, a TLS handshake failed): no gateway got the request.
            cause = exc.__cause__ if isinstance(exc, GatewayNotReached) else exc
            raise GatewayUnavailable(f"gateway {self.config.gateway}: {cause!r}",
                                     writes_ended=isinstance(exc, GatewayNotReached)) from None
        if response.status != 200:
            text = response.read()
            self._connections.give_back(conn, response)
            code, message = parse_error(text)
            if response.status >= 500:
                raise GatewayUnavailable(f"gateway {response.status} {code}: {message}",
                                         writes_ended=response.getheader(WRITES_MAY_LAND_HEADER) is None)
            raise GatewayRefused(response.status, code, message)
        return conn, response

    def _nixl_request(
        self,
        request_id: str,
        keys: Sequence[str],
        target: _Target,
        on_token: Callable[[str], None],
        window: float | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """POST on a helper thread while this thread hands over notifications as they arrive.

        Returns or raises only once no WRITE of the request can land in ``target`` any more (see
        :meth:`_stop_gateway_writes`)."""
        wire = nixl_target(self._agent.get_agent_metadata(), target.layout, target.regions(), target.layer_stride)
        body = self._descriptor(keys, wire, window)
        outcome: dict[str, Any] = {}

        def post() -> None:
            try:
                conn, response = self._post(request_id, body)
            except (GatewayUnavailable, GatewayRefused) as exc:
                # A refusal (4xx) comes before any WRITE, or once the WRITEs ended.
                outcome["writes_ended"] = not isinstance(exc, GatewayUnavailable) or exc.writes_ended
                outcome["error"] = exc
                return
            # The gateway answers 200 once every WRITE ended.
            outcome["writes_ended"] = True
            try:
                outcome["mode"] = response.getheader(MODE_HEADER, "")
                outcome["summary"] = json.loads(response.read())
            except (OSError, http.client.HTTPException, ValueError) as exc:
                outcome["error"] = GatewayUnavailable(f"gateway {self.config.gateway} mid-request: {exc!r}",
                                                      writes_ended=True)
            finally:
                self._connections.give_back(conn, response)

        self._inbox.open(request_id)
        thread = threading.Thread(target=post, name=f"s3agg-{request_id[:8]}", daemon=True)
        thread.start()
        received: list[str] = []
        polling = Polling(self.config.request_timeout_s)
        try:
            while True:
                tokens = self._inbox.take(request_id)
                for token in tokens:
                    received.append(token)
                    on_token(token)
                finished = not thread.is_alive()
                if "error" in outcome:
                    raise outcome["error"]
                if finished:
                    # Every notification follows its data; the last one ends the read.
                    mode = outcome["mode"]
                    if len(received) >= (1 if mode == MODE_CHUNKWISE else self.layout.num_layers):
                        return mode, outcome["summary"]
                if polling.expired:
                    raise GatewayUnavailable(f"no complete delivery within {self.config.request_timeout_s}s")
                # Poll fast while layers flow, back off while they do not (bounded latency, little CPU).
                polling.sleep(progressed=bool(tokens))
        except BaseException as exc:
            # Given up (a timeout, a broken connection, the caller's callback failed) while the gateway may still
            # WRITE into the target: nothing else may be read into it before the gateway confirms it stopped.
            if not outcome.get("writes_ended"):
                self._stop_gateway_writes(request_id, exc)
            raise
        finally:
            self._inbox.close(request_id)

    def _stop_gateway_writes(self, request_id: str, cause: BaseException) -> None:
        """Cancel the request at the gateway; returns once it confirms that none of its WRITEs can land any more,
        else raises :class:`GatewayWritesAbandoned`: the caller must retire the target."""
        why = self._cancel(request_id)
        if why is None:
            logger.info("s3agg: request %s canceled; the gateway stopped its WRITEs", request_id)
            return
        RETIRED.inc()
        logger.warning("s3agg: request %s given up (%s) and the gateway did not confirm that its WRITEs stopped "
                       "(%s): the target is retired", request_id, cause, why)
        raise GatewayWritesAbandoned(request_id, why, lambda: self._confirm_stopped(request_id)) from cause

    def _confirm_stopped(self, request_id: str) -> bool:
        """A retired target's probe: the cancel sent again; True once the gateway confirms."""
        why = self._cancel(request_id)
        if why is not None:
            logger.info("s3agg: request %s: the gateway has not confirmed that its WRITEs stopped (%s); its target "
                        "stays retired", request_id, why)
            return False
        RELEASED.inc()
        logger.warning("s3agg: request %s: the gateway confirmed that its WRITEs stopped; its target is released",
                       request_id)
        return True

    def _cancel(self, request_id: str) -> str | None:
        """Cancel the request at the gateway: None once it confirms that none of its WRITEs can land, else why not."""
        answer: dict[str, Any] = {}

        def cancel() -> None:
            try:
                conn, response = post_signed(self.config.gateway, self._cancel_path, b"", self._credentials,
                                             self.config.s3_config.region, request_id, self.config.connect_timeout_s,
                                             self.config.cancel_timeout_s, self._connections)  # fmt: skip
                try:
                    text = response.read()
                finally:
                    self._connections.give_back(conn, response)
                reply = json.loads(text) if response.status == 200 else None
                if isinstance(reply, dict) and reply.get(CANCEL_STOPPED) is True:
                    answer["stopped"] = True
                else:
                    answer["why"] = f"cancel answered {response.status}: {text[:200]!r}"
            except (OSError, http.client.HTTPException, ValueError) as exc:
                answer["why"] = f"cancel failed: {exc!r}"

        thread = threading.Thread(target=cancel, name=f"s3agg-cancel-{request_id[:8]}", daemon=True)
        thread.start()
        polling = Polling(self.config.cancel_timeout_s)
        while thread.is_alive():
            # The gateway answers once its WRITE in flight ended, and that may need this agent to progress UCX
            # (polling notifications does; the given-up request's late ones are dropped).
            polling.sleep(progressed=bool(self._inbox.take(request_id)))
        return None if answer.get("stopped") else answer.get("why", "no answer")

    def _http_request(
        self,
        request_id: str,
        keys: Sequence[str],
        target: _Target,
        on_token: Callable[[str], None],
        window: float | None,
    ) -> tuple[str, dict[str, Any]]:
        """Layers (with their digests) arrive as response frames, received straight into the target where its
        layout matches the frame's (else into a scratch buffer, then placed by numpy)."""
        n, layout = len(keys), self.layout
        region = layer_region_bytes(n, layout.layer_block_bytes)
        conn, response = self._post(request_id, self._descriptor(keys, http_target(), window))
        mode = response.getheader(MODE_HEADER, "")
        scratch: np.ndarray | None = None
        try:
            while True:
                kind, index, length = FRAME.unpack(_read_exact(response, FRAME.size))
                if kind == FRAME_LAYER and index < layout.num_layers and length == region:
                    if target.layout == LAYOUT_LAYER_MAJOR:
                        _readinto_exact(response, _host_view(target.addrs[index], length))
                    else:
                        scratch = np.empty(region, dtype=np.uint8) if scratch is None else scratch
                        _readinto_exact(response, scratch)
                        target.place_layer(index, scratch)
                    on_token(str(index))
                elif kind == FRAME_CHUNKS and length == n * layout.object_bytes:
                    target.receive_objects(lambda view: _readinto_exact(response, view))
                    on_token(ALL_LAYERS)
                elif kind in (FRAME_END, FRAME_ERROR) and length > _MAX_TEXT_FRAME_BYTES:
                    # A summary or an error is small: a gateway naming more is not one to allocate it for.
                    raise GatewayUnavailable(f"frame kind={kind} of {length} bytes exceeds {_MAX_TEXT_FRAME_BYTES}")
                elif kind == FRAME_END:
                    summary = json.loads(_read_exact(response, length))
                    response.read()  # the stream's end: the connection can serve the next request
                    return mode, summary
                elif kind == FRAME_ERROR:
                    raise GatewayUnavailable(f"gateway failed mid-stream: {_read_exact(response, length)!r}")
                else:
                    raise GatewayUnavailable(f"unexpected frame kind={kind} index={index} length={length}")
        except (OSError, http.client.HTTPException) as exc:
            raise GatewayUnavailable(f"gateway {self.config.gateway} mid-stream: {exc!r}") from None
        finally:
            self._connections.give_back(conn, response)  # closed unless read to the end

    # --- fallback ------------------------------------------------------------------------------

    def _count_fallback(self, op: str, request_id: str, exc: Exception) -> None:
        FALLBACKS.labels(op).inc()
        logger.warning("s3agg: request %s falls back to plain S3 range reads: %s", request_id, exc)

    def read_ranges(
        self, keys: Sequence[str], layer_addrs: Sequence[int], on_layer: Callable[[int], None], *, start: int = 0
    ) -> None:
        """Without the gateway: layers ``start..L-1`` into layer-major regions by plain ranged GETs, one per chunk
        and layer; what the fallback of :meth:`read_layerwise` does (the benchmark's per-chunk baseline)."""
        self._read_ranges(keys, _Target(self.layout, LAYOUT_LAYER_MAJOR, [int(a) for a in layer_addrs], len(keys)),
                          on_layer, start=start)

    def _read_ranges(self, keys: Sequence[str], target: _Target, on_layer: Callable[[int], None], *, start: int) -> None:
        """Each layer's N GETs run in parallel and land straight at their target offsets. The trailers come
        with the first layer's GETs (one more per chunk): straight into place for a chunk-major target, else
        into a small registered buffer whose digests of each layer are placed before the layer is handed over."""
        layout, n = self.layout, len(keys)
        s, num_layers = layout.layer_block_bytes, layout.num_layers
        dev_ids = obj_device_ids(self._agent, n)
        trailer_at = target.trailer_at()
        trailers = None if trailer_at is not None else np.empty((n, num_layers, DIGEST_BYTES), dtype=np.uint8)
        registrations = [
            self._agent.register_memory([(0, layout.object_bytes, d, key) for d, key in zip(dev_ids, keys)], OBJ)]
        chunks = np.arange(n, dtype=np.int64)
        if trailers is not None:
            registrations.append(self._agent.register_memory([(trailers.ctypes.data, trailers.nbytes, 0, "")], "DRAM"))
            trailer_at = trailers.ctypes.data + chunks * layout.trailer_bytes
        dev_id_column = np.arange(dev_ids.start, dev_ids.stop)
        trailer_reads = (descriptors(trailer_at, layout.trailer_bytes),
                         descriptors(layout.full_block_bytes, layout.trailer_bytes, dev_id_column))
        abandoned = False
        try:
            for layer in range(start, num_layers):
                reads = [(descriptors(target.block_addrs(layer), s), descriptors(layer * s, s, dev_id_column))]
                if not all(run_nixl_transfers(self._agent, "READ", reads + ([trailer_reads] if layer == start else []),
                                              OBJ, self.config.s3_config.io_timeout_s)):
                    raise RuntimeError(f"s3agg: ranged reads of layer {layer} failed")
                if trailers is not None:
                    _host_view(target.addrs[layer] + n * s, n * DIGEST_BYTES).reshape(n, DIGEST_BYTES)[:] = \
                        trailers[:, layer, :]
                on_layer(layer)
        except TransferAbandoned as exc:
            abandoned = True  # NIXL may still use the registrations and write the trailer buffer until they ended
            exc.when_ended(lambda trailers=trailers: self._deregister(registrations))
            raise
        finally:
            if not abandoned:
                self._deregister(registrations)

    def _deregister(self, registrations: list[Any]) -> None:
        for registration in registrations:
            self._agent.deregister_memory(registration)


@dataclass(frozen=True)
class _Target:
    """Where a read's layers go: ``addrs`` one per layer (layer-major), one per chunk (chunk-major: the object;
    strided: its layer 0, with ``trailer_addrs`` and ``layer_stride``)."""

    store: BlockLayout
    layout: TargetLayout
    addrs: list[int]
    num_chunks: int
    trailer_addrs: list[int] | None = None
    layer_stride: int = 0

    def __post_init__(self) -> None:
        expected = self.store.num_layers if self.layout == LAYOUT_LAYER_MAJOR else self.num_chunks
        if self.layout not in (LAYOUT_LAYER_MAJOR, LAYOUT_CHUNK_MAJOR, LAYOUT_STRIDED):
            raise ValueError(f"unknown target layout {self.layout!r}")
        if len(self.addrs) != expected:
            raise ValueError(f"a {self.layout} target of {self.num_chunks} chunks needs {expected} regions, "
                             f"got {len(self.addrs)}")
        if self.layout == LAYOUT_STRIDED and (self.trailer_addrs is None or len(self.trailer_addrs) != self.num_chunks
                                              or self.layer_stride < self.store.layer_block_bytes):
            raise ValueError("a strided target needs a trailer address per chunk and a stride of a Layer Block or more")

    def regions(self) -> list[list[int]]:
        if self.layout == LAYOUT_STRIDED:
            return [[first, trailer] for first, trailer in zip(self.addrs, self.trailer_addrs)]
        size = (layer_region_bytes(self.num_chunks, self.store.layer_block_bytes)
                if self.layout == LAYOUT_LAYER_MAJOR else self.store.object_bytes)
        return [[addr, size] for addr in self.addrs]

    def block_addrs(self, layer: int) -> np.ndarray:
        """Address of every chunk's Layer Block ``layer``."""
        s = self.store.layer_block_bytes
        if self.layout == LAYOUT_LAYER_MAJOR:
            return self.addrs[layer] + np.arange(self.num_chunks, dtype=np.int64) * s
        return np.asarray(self.addrs, dtype=np.int64) + layer * (self.layer_stride or s)

    def trailer_at(self) -> np.ndarray | None:
        """Where each chunk's whole trailer goes, or None (layer-major: digests sit in the layers' regions)."""
        if self.layout == LAYOUT_STRIDED:
            return np.asarray(self.trailer_addrs, dtype=np.int64)
        if self.layout == LAYOUT_CHUNK_MAJOR:
            return np.asarray(self.addrs, dtype=np.int64) + self.store.full_block_bytes
        return None

    def place_layer(self, layer: int, region: np.ndarray) -> None:
        """A layer-major region of ``layer`` (blocks, then digests) into a chunk-major or strided target."""
        s = self.store.layer_block_bytes
        blocks = region[: self.num_chunks * s].reshape(self.num_chunks, s)
        digests = region[self.num_chunks * s :].reshape(self.num_chunks, DIGEST_BYTES)
        for j, (block_addr, trailer_addr) in enumerate(zip(self.block_addrs(layer).tolist(), self.trailer_at().tolist())):
            # one memcpy per chunk and part
            _host_view(block_addr, s)[:] = blocks[j]
            _host_view(trailer_addr + layer * DIGEST_BYTES, DIGEST_BYTES)[:] = digests[j]

    def receive_objects(self, receive: Callable[[np.ndarray], None]) -> None:
        """Every stored object, in chunk order, from ``receive(view)`` (which fills ``view``)."""
        size = self.store.object_bytes
        if self.layout == LAYOUT_CHUNK_MAJOR:
            for addr in self.addrs:  # each object straight into its region
                receive(_host_view(addr, size))
            return
        objects = np.empty((self.num_chunks, size), dtype=np.uint8)
        receive(objects)
        region = np.empty(layer_region_bytes(self.num_chunks, self.store.layer_block_bytes), dtype=np.uint8)
        for layer in range(self.store.num_layers):
            if self.layout == LAYOUT_LAYER_MAJOR:
                _place_layer(self.store, layer, objects, _host_view(self.addrs[layer], region.size))
            else:
                _place_layer(self.store, layer, objects, region)
                self.place_layer(layer, region)


def _strided_target(layout: BlockLayout, segments: Sequence[np.ndarray]) -> _Target:
    """A layer-major pool's slots (``HostBufferPool.slot_segments``: L Layer Blocks at one stride, then the
    trailer) as a strided target; anything else is refused."""
    s, num_layers = layout.layer_block_bytes, layout.num_layers
    firsts, trailers, strides = [], [], set()
    for pieces in segments:
        lengths = pieces[:, 1].tolist()
        if lengths != [s] * num_layers + [layout.trailer_bytes]:
            raise ValueError(f"s3agg reads into {num_layers} Layer Blocks and a trailer per object, got pieces {lengths}")
        addrs = pieces[:, 0].astype(np.int64)
        steps = set(np.diff(addrs[:num_layers]).tolist()) or {s}
        strides |= steps
        firsts.append(int(addrs[0]))
        trailers.append(int(addrs[-1]))
    if len(strides) != 1:
        raise ValueError(f"s3agg reads layers at one stride, got {sorted(strides)}")
    return _Target(layout, LAYOUT_STRIDED, firsts, len(segments), trailers, strides.pop())


class GatewayNotReached(OSError):
    """No connection to the gateway (refused, timed out, or its TLS handshake failed): nothing was sent."""


class GatewayConnections:
    """Connections to the gateway kept open between requests, one request at a time each: a connect costs a
    round trip to a gateway across a network (more with TLS), and a hit is one request."""

    def __init__(self, gateway: str, connect_timeout_s: float, keep: int = 8, ca_bundle: str | None = None) -> None:
        url = urlsplit(gateway)
        self._host, self._port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        # TLS: the certificate is checked against ca_bundle (or the system's CAs), host name included.
        self._tls = ssl.create_default_context(cafile=ca_bundle) if url.scheme == "https" else None
        self._connect_timeout_s = connect_timeout_s
        self._keep = keep
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self.opened = 0  # connections opened so far

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it served a request before."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
            self.opened += 1
        if self._tls is not None:
            return http.client.HTTPSConnection(self._host, self._port, timeout=self._connect_timeout_s,
                                               context=self._tls), False
        return http.client.HTTPConnection(self._host, self._port, timeout=self._connect_timeout_s), False

    def give_back(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """Keep ``conn`` for the next request if its response was read to the end and the gateway keeps it open."""
        if response.isclosed() and not response.will_close:
            with self._lock:
                if len(self._idle) < self._keep:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def post_signed(
    gateway: str,
    path: str,
    body: bytes,
    credentials: Credentials,
    region: str,
    request_id: str,
    connect_timeout_s: float,
    request_timeout_s: float,
    connections: GatewayConnections | None = None,
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST ``body`` to ``gateway + path`` signed with SigV4; returns the connection and its response.

    Without ``connections``, one new connection (an https:// gateway checked against the system's CAs). With
    ``connections``, an idle kept-alive connection is used first; one the
    gateway closed meanwhile (its keep-alive ran out) fails before the gateway
    saw the request, which then goes once more on a new connection. The caller
    hands the connection back (:meth:`GatewayConnections.give_back`) or closes it.
    """
    url = urlsplit(gateway)
    connections = connections or GatewayConnections(gateway, connect_timeout_s, keep=0)
    request = AWSRequest("POST", f"{url.scheme}://{url.netloc}{path}", data=body,
                         headers={"content-type": "application/json", REQUEST_ID_HEADER: request_id})
    # A snapshot: refreshable credentials could renew between reading the key id and the secret.
    S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(request)
    while True:
        conn, reused = connections.take()
        try:
            if conn.sock is None:
                try:
                    conn.connect()
                except OSError as exc:
                    raise GatewayNotReached(f"connecting to {gateway} failed") from exc
            conn.sock.settimeout(request_timeout_s)
            conn.request("POST", path, body=body, headers=dict(request.headers.items()))
            return conn, conn.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            conn.close()
            if not reused:
                raise
        except BaseException:
            conn.close()
            raise


def parse_error(text: bytes) -> tuple[str, str]:
    """(Code, Message) of an S3 XML error body."""
    try:
        root = ET.fromstring(text)
        return root.findtext("Code", "Unknown"), root.findtext("Message", "")
    except ET.ParseError:
        return "Unknown", text[:200].decode(errors="replace")


def _place_layer(layout: BlockLayout, layer: int, objects: np.ndarray, region: np.ndarray) -> None:
    """Layer ``layer`` of stored objects ``(n, object_bytes)`` into its layer-major region (blocks, then digests)."""
    n, s = objects.shape[0], layout.layer_block_bytes
    start, end = layout.layer_range(layer)
    region[: n * s].reshape(n, s)[:] = objects[:, start:end]
    start, end = layout.digest_range(layer)
    region[n * s :].reshape(n, DIGEST_BYTES)[:] = objects[:, start:end]


def _read_exact(response: http.client.HTTPResponse, size: int) -> bytes:
    data = response.read(size)
    if len(data) != size:
        raise GatewayUnavailable(f"response ended after {len(data)} of {size} bytes")
    return data


def _readinto_exact(response: http.client.HTTPResponse, buffer: np.ndarray) -> None:
    got = response.readinto(memoryview(buffer).cast("B"))
    if got != buffer.nbytes:
        raise GatewayUnavailable(f"response ended after {got} of {buffer.nbytes} bytes")
