"""``s3agg-gateway``: the HTTP service (S3 control path, SigV4, XML errors, /metrics, the aggregated read).

Endpoints:

- ``POST /<bucket>?aggregate``: the extension request. SigV4-signed like any S3
  request; its JSON body is the descriptor (see :mod:`s3agg_gateway_ext.descriptor`).
  NIXL targets get a JSON summary once every layer is written and notified;
  HTTP targets get a stream of frames (see :mod:`nixl_backends.s3agg_protocol`).
  Either way ``x-s3agg-mode`` says chunkwise or layerwise.
- ``POST /<bucket>?aggregate&cancel``: the client gave up on a NIXL request; no
  WRITE of it starts any more, and the answer says whether one may still land
  (see :mod:`s3agg_gateway_ext.cancellation`).
- ``GET /healthz`` and ``GET /metrics`` (Prometheus), unauthenticated.
- Any other S3 request is authenticated; on a POSIX-backed bucket it is served
  (:mod:`s3agg_gateway_ext.s3_api`: the gateway is that store's S3 endpoint),
  on an S3-backed one answered ``NotImplemented``: ordinary S3 traffic goes to
  the store directly (the gateway adds nothing to a single-object request).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from nixl_backends.http_head_timeout import head_timeout_protocol
from nixl_backends.nixl_io import TransferAbandoned
from nixl_backends.s3agg_protocol import (
    CANCEL_QUERY,
    CANCEL_STOPPED,
    EXTENSION_QUERY,
    FRAME,
    FRAME_CHUNKS,
    FRAME_END,
    FRAME_ERROR,
    FRAME_LAYER,
    MODE_HEADER,
    REQUEST_ID_HEADER,
    WRITES_MAY_LAND_HEADER,
)
from s3agg_gateway_ext.aggregator import Aggregator, DeliveryError, Job, RequestCanceled, StorageError
from s3agg_gateway_ext.cancellation import Cancellations
from s3agg_gateway_ext.config import GatewayConfig, load_config
from s3agg_gateway_ext.descriptor import DescriptorError, HttpTarget, NixlTarget, parse_descriptor
from s3agg_gateway_ext.s3_api import PosixBucketAPI
from s3agg_gateway_ext.sigv4 import STREAMING_UNSIGNED_TRAILER, UNSIGNED, error_xml, verify_headers, verify_payload

logger = logging.getLogger(__name__)

# Failures after validation: the store or the client's side broke mid-request.
_RUNTIME_ERRORS = (StorageError, DeliveryError, TransferAbandoned, TimeoutError)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("s3agg_requests_total", "Aggregated reads by mode, target and outcome",
                                ["mode", "target", "outcome"], registry=self.registry)
        self.refused = Counter("s3agg_refused_total", "Requests refused before any read, by S3 error code",
                               ["code"], registry=self.registry)
        self.phase = Histogram("s3agg_request_phase_seconds",
                               "Per-request time split: control, admission, storage_read, delivery, pacing, total",
                               ["phase"], registry=self.registry,
                               buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30))
        self.delivered = Counter("s3agg_delivered_bytes_total", "Payload bytes delivered",
                                 ["mode", "target"], registry=self.registry)
        self.active = Gauge("s3agg_active_requests", "Aggregated reads in progress", registry=self.registry)
        self.writing = Gauge("s3agg_nixl_deliveries_in_progress",
                             "NIXL deliveries in progress: a WRITE into a client's buffer posted, not yet ended",
                             registry=self.registry)
        self.cancels = Counter("s3agg_cancels_total", "Cancels by answer: stopped, or a WRITE may still land",
                               ["answer"], registry=self.registry)
        self.staging = Gauge("s3agg_staging_bytes", "Staging memory taken from max_staging_bytes, abandoned included",
                             registry=self.registry)
        self.staging_abandoned = Gauge("s3agg_staging_abandoned_bytes",
                                       "Staging kept for transfers abandoned at io_timeout_s until they end",
                                       registry=self.registry)


def _runtime_code(exc: Exception) -> str:
    if isinstance(exc, StorageError):
        return "StorageReadFailed"
    return "SlowDown" if isinstance(exc, TimeoutError) else "DeliveryFailed"


# Payload forms accepted per method beside ?aggregate (signed only). A PUT is signed; NIXL OBJ's form (the AWS
# C++ SDK's aws-chunked body with a checksum trailer, headers signed) only where allow_unsigned_payload says so,
# over TLS: its body is a chunk object whose trailer keyed integrity checks on every read. Bodiless requests may
# say UNSIGNED-PAYLOAD (a body they carry is unused).
_PAYLOADS = {
    "PUT": ("signed",),
    "GET": ("signed", UNSIGNED), "HEAD": ("signed", UNSIGNED), "DELETE": ("signed", UNSIGNED),
}  # fmt: skip
_UNSIGNED_PUT = ("signed", STREAMING_UNSIGNED_TRAILER)


class Gateway:
    """The request handlers around one :class:`Aggregator`."""

    def __init__(self, config: GatewayConfig, aggregator: Aggregator) -> None:
        self.config = config
        self.aggregator = aggregator
        self.metrics = Metrics()
        self.cancellations = Cancellations()
        self.metrics.staging.set_function(lambda: aggregator.staging_budget.in_use)
        self.metrics.staging_abandoned.set_function(lambda: aggregator.staging_reaper.held_bytes)
        # Buckets whose backing the gateway serves as plain S3 too (posix): bucket -> its S3 API.
        self.files = {bucket: PosixBucketAPI(backing) for bucket, backing in aggregator.backings.items()
                      if backing.serves_s3}
        self.payloads = {**_PAYLOADS, "PUT": _UNSIGNED_PUT} if config.allow_unsigned_payload else _PAYLOADS

    def _error(self, exc: DescriptorError, resource: str, request_id: str) -> Response:
        self.metrics.refused.labels(exc.code).inc()
        logger.info("request %s refused: %d %s: %s", request_id, exc.status, exc.code, exc.message)
        return Response(error_xml(exc.code, exc.message, resource, request_id), status_code=exc.status,
                        media_type="application/xml", headers={REQUEST_ID_HEADER: request_id})

    async def _authenticated_body(self, request: Request, payloads: tuple[str, ...]) -> bytes:
        """The request's body, read only once its signed headers verified, at most ``max_body_bytes`` of it
        (413 beyond), and matching the signed payload hash; ``payloads``: the accepted payload forms."""
        payload_hash = verify_headers(
            request.method, request.scope.get("raw_path", b"").decode("latin-1") or request.url.path,
            request.scope.get("query_string", b"").decode("latin-1"), request.headers,
            self.config.client_access_key, self.config.client_secret_key, payloads=payloads)  # fmt: skip
        limit = self.config.max_body_bytes
        too_large = DescriptorError(413, "EntityTooLarge", f"request body above this gateway's max_body_bytes={limit}")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        body = b"".join(chunks)
        verify_payload(payload_hash, body)
        return body

    def _finish(self, job: Job, target: str, outcome: str, started: float) -> None:
        job.timings["total_s"] = time.monotonic() - started
        self.metrics.requests.labels(job.mode, target, outcome).inc()
        for phase, seconds in job.timings.items():
            self.metrics.phase.labels(phase.removesuffix("_s")).observe(seconds)
        if outcome == "ok":
            self.metrics.delivered.labels(job.mode, target).inc(job.desc.payload_bytes)
        self.metrics.active.dec()
        t = job.timings
        logger.info(
            "request %s %s bucket=%s chunks=%d layers=%d S=%d mode=%s target=%s control=%.4fs "
            "admission=%.4fs storage_read=%.4fs delivery=%.4fs pacing=%.4fs total=%.4fs",
            job.request_id, outcome, job.desc.bucket, job.desc.num_chunks, job.desc.num_layers,
            job.desc.layer_bytes, job.mode, target, t["control_s"], t["admission_s"], t["storage_read_s"],
            t["delivery_s"], t["pacing_s"], t["total_s"])

    async def aggregate(self, request: Request) -> Response:
        started = time.monotonic()
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        bucket = request.path_params["bucket"]
        try:
            # Signed: the signature covers the descriptor, so a captured request cannot carry another.
            body = await self._authenticated_body(request, ("signed",))
            desc = parse_descriptor(bucket, body, self.config)
            job = await run_in_threadpool(self.aggregator.prepare, request_id, desc)
            if isinstance(desc.target, NixlTarget):
                self.cancellations.start(job)  # refused if its cancel came first
        except DescriptorError as exc:
            return self._error(exc, f"/{bucket}", request_id)
        self.metrics.active.inc()
        headers = {REQUEST_ID_HEADER: request_id, MODE_HEADER: job.mode}
        if isinstance(desc.target, HttpTarget):
            return StreamingResponse(self._frames(job, started), media_type="application/octet-stream",
                                     headers=headers)
        try:
            await run_in_threadpool(self._deliver_nixl, job)
        except RequestCanceled as exc:
            outcome, status, code, message = "canceled", 409, "RequestCanceled", str(exc)
        except _RUNTIME_ERRORS as exc:
            code = _runtime_code(exc)
            outcome, status, message = "error", 503 if code == "SlowDown" else 502, str(exc)
        else:
            outcome = "ok"
        finally:
            self.cancellations.end(job)
        self._finish(job, "nixl", outcome, started)
        if outcome == "ok":
            return JSONResponse(job.summary(), headers=headers)
        if job.write_abandoned:
            # Answered while a WRITE may still land: the client must not take this answer for the end of them.
            headers[WRITES_MAY_LAND_HEADER] = "true"
        return Response(error_xml(code, message, f"/{bucket}", request_id), status_code=status,
                        media_type="application/xml", headers=headers)

    async def cancel(self, request: Request) -> Response:
        """Stop a NIXL request's WRITEs for a client that gave up on it; ``{"stopped": true}`` once none can land."""
        request_id = request.headers.get(REQUEST_ID_HEADER, "")
        try:
            await self._authenticated_body(request, ("signed",))
            # Waits for a WRITE in flight, which ends (or is abandoned) within io_timeout_s.
            stopped = await run_in_threadpool(self.cancellations.cancel, request_id, self.config.io_timeout_s)
        except DescriptorError as exc:
            return self._error(exc, request.url.path, request_id[:64])
        answer = "stopped" if stopped else "writes_may_land"
        self.metrics.cancels.labels(answer).inc()
        logger.info("request %s canceled by its client: %s", request_id, answer)
        return JSONResponse({CANCEL_STOPPED: stopped}, headers={REQUEST_ID_HEADER: request_id})

    def _deliver_nixl(self, job: Job) -> None:
        with contextlib.closing(self.aggregator.stream(job)) as units:
            for unit in units:
                with self.metrics.writing.track_inprogress():
                    self.aggregator.deliver_nixl(job, unit)

    def _frames(self, job: Job, started: float) -> Iterator[bytes | memoryview]:
        """The HTTP delivery: one frame per layer and its digests (or one of all objects), then an end frame."""
        outcome = "error"
        try:
            with contextlib.closing(self.aggregator.stream(job)) as units:
                for unit in units:
                    kind = FRAME_LAYER if unit.kind == "layer" else FRAME_CHUNKS
                    yield FRAME.pack(kind, unit.index, unit.nbytes)
                    for part in unit.parts:
                        # Contiguous already unless k > 1 (then one numpy gather of the layer).
                        yield memoryview(part if part.flags.c_contiguous else part.copy()).cast("B")
            outcome = "ok"
            summary = json.dumps(job.summary()).encode()
            yield FRAME.pack(FRAME_END, 0, len(summary)) + summary
        except _RUNTIME_ERRORS as exc:
            message = json.dumps({"code": _runtime_code(exc), "message": str(exc)}).encode()
            yield FRAME.pack(FRAME_ERROR, 0, len(message)) + message
        finally:
            self._finish(job, "http", outcome, started)

    async def other(self, request: Request) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        try:
            body = await self._authenticated_body(request, self.payloads.get(request.method, ("signed",)))
            bucket, _, key = request.path_params["bucket"].partition("/")
            files = self.files.get(bucket)
            if files is not None:
                query = request.scope.get("query_string", b"").decode("latin-1")
                try:
                    response = await files.handle(request.method, key, query, request.headers, body)
                except OSError as exc:  # the disk, not the request: a 500 the client may retry
                    logger.warning("request %s: %s /%s failed: %s", request_id, request.method, key[:200], exc)
                    raise DescriptorError(500, "InternalError", "the store root could not serve the request") from None
                response.headers[REQUEST_ID_HEADER] = request_id
                return response
            if self.files:
                raise DescriptorError(404, "NoSuchBucket", f"bucket {bucket[:64]} is not served by this gateway")
            raise DescriptorError(
                501, "NotImplemented",
                f"this gateway serves only POST /<bucket>?{EXTENSION_QUERY}; send ordinary S3 requests to the "
                f"store at {self.config.store_config.endpoint or 'its AWS endpoint'}")
        except DescriptorError as exc:
            return self._error(exc, request.url.path, request_id)

    async def dispatch(self, request: Request) -> Response:
        query = request.scope.get("query_string", b"").decode("latin-1").split("&")
        if request.method == "POST" and EXTENSION_QUERY in query and "/" not in request.path_params["bucket"]:
            return await (self.cancel(request) if CANCEL_QUERY in query else self.aggregate(request))
        return await self.other(request)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            return PlainTextResponse("ok")

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette):
            yield
            self.aggregator.close()

        return Starlette(routes=[
            Route("/healthz", health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/{bucket:path}", self.dispatch, methods=["GET", "PUT", "POST", "HEAD", "DELETE"]),
        ], lifespan=lifespan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="s3agg-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML config (see configs/gateway.yaml)")
    parser.add_argument("--host", help="override the config's host")
    parser.add_argument("--port", type=int, help="override the config's port")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    config.host = args.host or config.host
    config.port = args.port or config.port
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.info("starting with %s", config)  # secrets are repr=False fields
    gateway = Gateway(config, Aggregator(config))
    # Bounded as the router is: connections, idle keep-alive, an unfinished request head.
    uvicorn.run(gateway.app(), host=config.host, port=config.port, log_level="warning", access_log=False,
                http=head_timeout_protocol(config.head_timeout_s, config.max_connections),
                limit_concurrency=config.max_connections, timeout_keep_alive=5,
                h11_max_incomplete_event_size=64 << 10,
                ssl_certfile=config.tls_certfile, ssl_keyfile=config.tls_keyfile)


if __name__ == "__main__":
    main()
