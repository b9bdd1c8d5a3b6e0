"""``dualpath-router``: the OpenAI-compatible front of a DualPath PD cluster.

Per request: tokenize (or take token ids), look up the hit length in the
store, place it (PE, DE, read side), prefill on the PE with ``max_tokens=1``
and a :class:`PrefillRequest`, then hand the PE's :class:`PrefillHandoff` to
the DE and pass the DE's answer through. A DE that failed after the request may
have reached it may have pulled the hand-off's blocks: the request is prefilled
again for the next DE rather than handing it blocks the PE may have reused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from nixl_backends.configuration import ConfigError
from nixl_backends.http_head_timeout import head_timeout_protocol

from dualpath_connector.protocol import PrefillHandoff, PrefillRequest, ProtocolError, sse_lines

from dualpath_router.accounting import Accounting
from dualpath_router.config import RouterConfig, load_router_config
from dualpath_router.credentials import EngineCredential, MetricsAccess
from dualpath_router.dispatcher import Dispatcher, Placement, QueueFull, QueueTimeout
from dualpath_router.heap import HeapTrimmer, limit_malloc_arenas
from dualpath_router.holds import HoldReleaser
from dualpath_router.lookup import HitLookup
from dualpath_router.policies import make_policy
from dualpath_router.prompts import REQUEST_ID_HEADER, BadRequest, PromptBuilder, RoutedRequest, request_id_of

logger = logging.getLogger(__name__)

# How long the router's HTTP server keeps an idle client connection open. A client that keeps connections alive
# must drop them sooner (dualpath_bench.replay's KEEPALIVE_EXPIRY_S): one sent as the server closes it fails.
IDLE_KEEP_ALIVE_S = 5


def error_response(status: int, message: str, *, err_type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape, as vLLM answers it."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class RouterMetrics:
    """The router's own /metrics: counters it increments, gauges read from accounting at scrape time."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dualpath_router_requests", "Requests prefilled, by policy and read side",
            ["policy", "read_side"], registry=self.registry,
        )
        self.prompt_tokens = Counter("dualpath_router_prompt_tokens", "Prompt tokens routed", registry=self.registry)
        self.hit_tokens = Counter("dualpath_router_hit_tokens", "Prompt tokens found in the store",
                                  registry=self.registry)
        self.retries = Counter("dualpath_router_retries", "Attempts moved to another engine after a failure",
                               ["role"], registry=self.registry)
        self.reprefills = Counter("dualpath_router_reprefills",
                                  "Decode retries that prefilled again: the failed DE may have pulled the hand-off",
                                  registry=self.registry)
        self.rejected = Counter("dualpath_router_rejected_requests", "Requests answered with an error, by reason",
                                ["reason"], registry=self.registry)
        self.holds_released = Counter(
            "dualpath_router_released_holds", "PE holds ended by the router because no DE would pull them, by reason",
            ["reason"], registry=self.registry,
        )
        self._dispatcher = dispatcher
        self.registry.register(self)

    def collect(self):
        accounting = self._dispatcher.accounting
        labels = ["engine", "role"]
        tokens = GaugeMetricFamily("dualpath_router_engine_unfinished_tokens",
                                   "Tokens dispatched to the engine and not finished (PE: to compute, hits excluded; DE: prompts)", labels=labels)
        requests = GaugeMetricFamily("dualpath_router_engine_unfinished_requests",
                                     "Unfinished requests (router's count or the engine's, the larger)",
                                     labels=labels)
        healthy = GaugeMetricFamily("dualpath_router_engine_healthy", "1 if the last scrape/dispatch succeeded",
                                    labels=labels)
        for engine in accounting.engines.values():
            tokens.add_metric([engine.name, engine.role], engine.unfinished_tokens)
            requests.add_metric([engine.name, engine.role], engine.unfinished_requests)
            healthy.add_metric([engine.name, engine.role], 1.0 if engine.healthy else 0.0)
        read_queue = GaugeMetricFamily("dualpath_router_node_read_queue_tokens",
                                       "Hit tokens queued for reading on the node", labels=["node"])
        for node, queued in sorted(accounting.read_queues().items()):
            read_queue.add_metric([node], queued)
        scheduling = self._dispatcher.config.scheduling
        yield from (tokens, requests, healthy, read_queue)
        yield GaugeMetricFamily("dualpath_router_queued_requests", "Requests waiting for a PE under beta",
                                value=self._dispatcher.queued_requests)
        yield GaugeMetricFamily("dualpath_router_prefill_tokens_per_second", "Estimated prefill compute rate per PE (tokens computed per second)",
                                value=accounting.prefill_rate.tokens_per_s)
        yield GaugeMetricFamily("dualpath_router_read_tokens_per_second", "Estimated store read rate per node",
                                value=accounting.read_rate.tokens_per_s)
        yield GaugeMetricFamily("dualpath_router_alpha_tokens", "Short read queue threshold, in tokens",
                                value=accounting.alpha_tokens(scheduling.alpha_s))
        yield GaugeMetricFamily("dualpath_router_beta_tokens", "Unfinished token limit per PE, in tokens",
                                value=accounting.beta_tokens(scheduling.beta_s))


class EngineFailed(Exception):
    """The engine failed before answering anything: the attempt may go to another engine.

    ``may_have_run``: the request may have reached the engine and started there (a DE may have pulled the
    hand-off's blocks); False only where nothing was sent or the engine refused it at its door.
    ``connection_broke``: the connection was closed or reset before any answer, which a kept-alive connection
    does when the engine closes it (its keep-alive timeout) just as the request goes out; the same engine may
    answer on a new connection, so it gets one more attempt per request before it counts as failed.
    """

    def __init__(self, message: str, *, may_have_run: bool = True, connection_broke: bool = False) -> None:
        super().__init__(message)
        self.may_have_run = may_have_run
        self.connection_broke = connection_broke

    @classmethod
    def sending(cls, exc: httpx.HTTPError) -> EngineFailed:
        """``exc`` raised by sending a request: one that failed while connecting sent nothing."""
        unsent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
        broke = isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError))
        return cls(f"{type(exc).__name__}: {exc}", may_have_run=not unsent, connection_broke=broke)


class EngineFailures:
    """One request's failed attempts per role: an engine is ruled out once it failed, or once its connection
    broke before an answer a second time (:attr:`EngineFailed.connection_broke`)."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}  # engine name: why it is ruled out
        self._broken: set[str] = set()  # engines whose connection broke once, still candidates

    def add(self, engine: str, exc: EngineFailed) -> None:
        if exc.connection_broke and engine not in self._broken:
            self._broken.add(engine)
        else:
            self.reasons[engine] = str(exc)

    @property
    def ruled_out(self) -> set[str]:
        return set(self.reasons)

    def __str__(self) -> str:
        return "; ".join(f"{name}: {why}" for name, why in self.reasons.items())


class HandoffSpent(Exception):
    """A DE failed after the request may have reached it, and the request is booked on another DE.

    The failed DE may have pulled the hand-off, ending the PE's hold: its blocks may already hold another
    request's KV, so the next DE must not read them. The request is prefilled again for the next DE.
    """


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # Read once at start-up: a router without it could not reach a guarded engine.
        self.credential = EngineCredential.from_env(config.engine_api_key_env)
        self.metrics_access = MetricsAccess(config.metrics_token_env)
        accounting = Accounting.build(
            config.prefill_engines,
            config.decode_engines,
            config.scheduling.prefill_tokens_per_s,
            config.scheduling.read_tokens_per_s,
            config.scheduling.rate_ewma_weight,
        )
        lookup = HitLookup(config.store, config.lookup_cache_chunks, config.lookup_cache_ttl_s)
        if config.namespace != "auto":
            lookup.namespace = config.namespace
        self.dispatcher = Dispatcher(config, accounting, make_policy(config.policy, config.scheduling), lookup)
        self.prompts = PromptBuilder(config)
        self.metrics = RouterMetrics(self.dispatcher)
        self.holds = HoldReleaser.from_env(config.timeouts.connect_s)
        self.client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        timeouts = self.config.timeouts
        self.client = httpx.AsyncClient(
            # On every engine request (the /v1 paths need it; /metrics and /health do not mind).
            headers=self.credential.headers(),
            timeout=httpx.Timeout(timeouts.prefill_s, connect=timeouts.connect_s),
            # Idle connections are dropped before the engines' uvicorn closes them (its keep-alive is
            # 5 s, httpx's default too): reusing one the engine is closing fails a request with no retry.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0),
        )
        background = [asyncio.create_task(self.dispatcher.refresh_forever(self.client))]
        if self.config.heap_trim_interval_s > 0:
            background.append(asyncio.create_task(self._trim_heap_forever(HeapTrimmer.of_this_process())))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.client.aclose()

    async def _trim_heap_forever(self, trimmer: HeapTrimmer) -> None:
        while trimmer.available:
            await asyncio.sleep(self.config.heap_trim_interval_s)
            await asyncio.to_thread(trimmer.trim)

    def build_app(self) -> FastAPI:
        app = FastAPI(title="dualpath-router", lifespan=self.lifespan)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        return app

    async def health(self) -> Response:
        accounting = self.dispatcher.accounting
        engines = {e.name: e.healthy for e in accounting.engines.values()}
        missing = [role for role in ("prefill", "decode") if not any(e.healthy for e in accounting.role(role))]
        if missing:
            return JSONResponse({"status": f"no healthy {' or '.join(missing)} engine", "engines": engines},
                                status_code=503)
        return JSONResponse({"status": "ok", "engines": engines})

    async def prometheus(self, request: Request) -> Response:
        refused = self.metrics_access.refusal(request.client.host if request.client else None,
                                              request.headers.get("authorization"))  # fmt: skip
        if refused is not None:
            why = (f"/metrics needs the bearer token in ${self.config.metrics_token_env}" if refused == 401 else
                   f"/metrics answers loopback clients only unless ${self.config.metrics_token_env} holds a token")
            return JSONResponse({"error": why}, status_code=refused)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> Response:
        data = [{"id": name, "object": "model", "owned_by": "dualpath-router"} for name in self.config.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> Response:
        try:
            request_id = request_id_of(request.headers)
            raw = await self._body(request)
            # Off the event loop: parsing and tokenizing a long prompt takes long enough to stall every stream.
            routed = await anyio.to_thread.run_sync(functools.partial(self.prompts.build, raw, chat=chat))
            routed = dataclasses.replace(routed, request_id=request_id)
        except BadRequest as exc:
            self.metrics.rejected.labels(exc.reason).inc()
            return error_response(exc.status, exc.message, err_type=exc.err_type, param=exc.param)
        except ClientDisconnect:
            logger.debug("a client went away while sending its request")
            self.metrics.rejected.labels("client_gone").inc()
            return Response(status_code=499)  # nobody reads it
        try:
            return await self._route(routed)
        except Exception:  # every accepted request gets an answer, even on a router bug
            logger.exception("request failed inside the router")
            self.metrics.rejected.labels("internal").inc()
            return error_response(500, "internal router error; see the router log", err_type="InternalServerError")

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 once it passes ``max_request_bytes`` (before it is all read)."""
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BadRequest(f"request body of {int(declared)} bytes, above this router's max_request_bytes={limit}",
                             status=413, reason="too_large", err_type="RequestEntityTooLarge")  # fmt: skip
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"request body above this router's max_request_bytes={limit}", status=413,
                                 reason="too_large", err_type="RequestEntityTooLarge")  # fmt: skip
            chunks.append(chunk)
        return b"".join(chunks)

    async def _route(self, routed: RoutedRequest) -> Response:
        hit_tokens = await self.dispatcher.lookup.hit_tokens(routed.token_ids, routed.cache_salt)
        try:
            return await self._prefill_and_decode(routed, hit_tokens)
        except QueueFull:
            self.metrics.rejected.labels("queue_full").inc()
            scheduling = self.config.scheduling
            response = error_response(
                429, f"{scheduling.max_queued_requests} requests already wait for a prefill engine "
                     "(scheduling.max_queued_requests); retry later", err_type="RateLimitError")  # fmt: skip
            response.headers["Retry-After"] = str(max(1, round(scheduling.beta_s)))
            return response
        except QueueTimeout:
            self.metrics.rejected.labels("queue_timeout").inc()
            scheduling = self.config.scheduling
            return error_response(
                503,
                f"every prefill engine stayed above beta ({scheduling.beta_s}s of work) for "
                f"scheduling.queue_timeout_s={scheduling.queue_timeout_s}s",
                err_type="ServiceUnavailableError",
            )

    async def _prefill_and_decode(self, routed: RoutedRequest, hit_tokens: int) -> Response:
        """Prefill, then decode; prefill again for the next DE while a failed DE spent the hand-off."""
        # Across the request's prefills: each DE fails at most twice, which bounds the prefills too.
        decode_failures = EngineFailures()
        rebooked: Placement | None = None
        while True:
            placement, handoff, failure = await self._prefill(routed, hit_tokens, rebooked)
            if placement is None:
                return failure
            try:
                return await self._decode(routed, placement, handoff, decode_failures)
            except HandoffSpent:
                self.metrics.reprefills.inc()
                rebooked = placement  # on the next DE, which the new prefill names to its PE

    async def _prefill(self, routed: RoutedRequest, hit_tokens: int, previous: Placement | None):
        """Prefill on a PE, moving to another PE while attempts fail.

        ``previous``: this request's placement whose DE stays booked for the
        prefill (a prefill again after a DE failed); None books a DE.
        Returns ``(placement, handoff, None)`` with the DE still
        booked, or ``(None, None, response)`` when the request is answered here
        (queue timeout, every PE failed, a PE's 4xx) with nothing booked.
        """
        failures = EngineFailures()
        while True:
            try:
                placement = await self.dispatcher.start_prefill(
                    len(routed.token_ids), hit_tokens, failures.ruled_out, previous.decode if previous else None
                )
            except BaseException:
                self._release_decode(previous)
                raise
            if placement is None:
                self._release_decode(previous)
                self.metrics.rejected.labels("prefill_failed").inc()
                return None, None, error_response(
                    503, f"all prefill engines failed: {failures}", err_type="ServiceUnavailableError"
                )
            previous = placement  # keeps its DE across PE attempts
            try:
                response = await self._post_prefill(routed, placement)
            except EngineFailed as exc:
                self.dispatcher.finish_prefill(placement, completed=False, engine_failed=True)
                failures.add(placement.prefill.name, exc)
                logger.warning("request %s: prefill engine %s failed before answering: %s", routed.request_id,
                               placement.prefill.name, exc)  # fmt: skip
                self.metrics.retries.labels("prefill").inc()
                continue
            except BaseException:
                self.dispatcher.finish_prefill(placement, completed=False)
                self.dispatcher.finish_decode(placement)
                raise
            completed = response.status_code < 400
            self.dispatcher.finish_prefill(placement, completed=completed)
            if not completed:  # the PE refused the request itself (4xx): the client's to see
                self.dispatcher.finish_decode(placement)
                return None, None, Response(response.content, response.status_code,
                                            media_type=response.headers.get("content-type"))
            self.metrics.requests.labels(self.config.policy, placement.read_side).inc()
            self.metrics.prompt_tokens.inc(placement.prompt_tokens)
            self.metrics.hit_tokens.inc(hit_tokens)
            return placement, _handoff(response, placement.prefill.name), None

    def _release_decode(self, placement: Placement | None) -> None:
        if placement is not None:
            self.dispatcher.finish_decode(placement)

    async def _post_prefill(self, routed: RoutedRequest, placement: Placement) -> httpx.Response:
        body = dict(routed.body)
        body.update(max_tokens=1, stream=False)
        for key in ("stream_options", "min_tokens"):  # meaningless for a one-token prefill
            body.pop(key, None)
        de_side_channel = placement.decode.config.side_channel if placement.decode_may_read else None
        body["kv_transfer_params"] = PrefillRequest(placement.read_side, de_side_channel).to_dict()
        try:
            response = await self.client.post(f"{placement.prefill.config.url}/v1/completions", json=body,
                                              headers={REQUEST_ID_HEADER: routed.request_id})  # fmt: skip
        except httpx.HTTPError as exc:
            raise EngineFailed.sending(exc) from None
        _raise_for_engine_failure(response, self.config.engine_api_key_env)
        if response.status_code < 400:
            try:
                answer = response.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise EngineFailed("answer is not a JSON object")
        return response

    async def _decode(self, routed: RoutedRequest, placement: Placement, handoff: PrefillHandoff | None,
                      failures: EngineFailures) -> Response:  # fmt: skip
        """Decode on a DE, moving to another DE while attempts fail before any byte reached the client.

        ``failures`` spans the request's prefills. Releases the DE booking exactly once: here,
        or when a stream ends; or raises :class:`HandoffSpent` (the hold released) with ``placement`` booked
        on the next DE, for the caller's prefill.
        """
        body = dict(routed.body)
        if handoff is not None:
            body["kv_transfer_params"] = handoff.to_dict()
        booked = True
        # Whether the PE's hold ends without the DE: set where the DE answered and so pulled.
        unpulled: str | None = "router error"
        try:
            while True:
                try:
                    upstream = await self._open_decode(placement, body, routed.request_id, read_all=not routed.stream)
                    break
                except EngineFailed as exc:
                    failures.add(placement.decode.name, exc)
                    logger.warning("request %s: decode engine %s failed before answering: %s", routed.request_id,
                                   placement.decode.name, exc)  # fmt: skip
                    self.metrics.retries.labels("decode").inc()
                    booked = self.dispatcher.replace_decode(placement, failures.ruled_out)
                    if not booked:
                        unpulled = "decode_failed"
                        self.metrics.rejected.labels("decode_failed").inc()
                        return error_response(503, f"all decode engines failed: {failures}",
                                              err_type="ServiceUnavailableError")
                    if exc.may_have_run and handoff is not None:
                        booked, unpulled = False, "decode_failed"  # the booking passes to the new prefill
                        raise HandoffSpent from None
            headers = {
                "x-dualpath-read-side": placement.read_side,
                "x-dualpath-prefill-engine": placement.prefill.name,
                "x-dualpath-decode-engine": placement.decode.name,
                REQUEST_ID_HEADER: routed.request_id,
            }
            if self.config.report_hit_tokens:
                headers["x-dualpath-hit-tokens"] = str(placement.hit_tokens)
            media_type = upstream.headers.get("content-type")
            form = routed.answer_form
            if upstream.is_closed:  # read whole: not streamed, or an error answer
                content = upstream.content
                if upstream.status_code < 400:
                    unpulled = None  # the DE answered: it pulled first
                    content = self.prompts.answer(content, form)
                else:
                    unpulled = "decode_refused"
                return Response(content, upstream.status_code, headers=headers, media_type=media_type)
            if form == "raw":
                chunks = upstream.aiter_raw()
            else:
                chunks = self.prompts.answer_stream(sse_lines(upstream.aiter_bytes()), form)
            ended = {"whole": False}

            async def close_stream() -> None:
                self.dispatcher.finish_decode(placement)
                await upstream.aclose()
                if not ended["whole"]:  # the client went away (or the DE broke off) maybe before the pull
                    await self._release_hold(handoff, "client_gone")

            booked, unpulled = False, None  # the stream releases both when it ends
            return UpstreamStream(self._pass_through(chunks, placement, ended), close_stream,
                                  status_code=upstream.status_code, headers=headers, media_type=media_type)
        finally:
            if booked:
                self.dispatcher.finish_decode(placement)
            if unpulled is not None:
                with anyio.CancelScope(shield=True):  # also when the client's disconnect cancels this request
                    await self._release_hold(handoff, unpulled)

    async def _release_hold(self, handoff: PrefillHandoff | None, reason: str) -> None:
        """No DE will pull ``handoff``: the PE frees its blocks now, not at the end of its lease."""
        if handoff is not None and await self.holds.release(handoff, reason):
            self.metrics.holds_released.labels(reason).inc()

    async def _open_decode(self, placement: Placement, body: dict, request_id: str, *,
                           read_all: bool) -> httpx.Response:  # fmt: skip
        """Send the DE request; with ``read_all`` (or an error status) the whole answer is read and closed."""
        request = self.client.build_request(
            "POST", f"{placement.decode.config.url}/v1/completions", json=body,
            headers={REQUEST_ID_HEADER: request_id},
            timeout=httpx.Timeout(self.config.timeouts.decode_s, connect=self.config.timeouts.connect_s),
        )
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise EngineFailed.sending(exc) from None
        if read_all or upstream.status_code >= 400:
            try:
                await upstream.aread()
            except httpx.HTTPError as exc:
                raise EngineFailed(f"answer broke off: {type(exc).__name__}: {exc}") from None
            finally:
                await upstream.aclose()
        _raise_for_engine_failure(upstream, self.config.engine_api_key_env)
        return upstream

    async def _pass_through(self, chunks: AsyncIterator[bytes], placement: Placement,
                            ended: dict[str, bool]) -> AsyncIterator[bytes]:  # fmt: skip
        try:
            async for chunk in chunks:
                yield chunk
            ended["whole"] = True
        except httpx.HTTPError as exc:
            # Bytes already reached the client: no retry; the client sees the stream end early.
            logger.warning("decode engine %s broke off the stream: %s", placement.decode.name, exc)


class UpstreamStream(StreamingResponse):
    """A streamed upstream answer whose ``on_close`` runs exactly once when the response ends.

    However it ends: finished, upstream broke off, or the client went away
    before the first chunk (an async generator that never started would
    never run its ``finally``).
    """

    def __init__(self, content: AsyncIterator[bytes], on_close, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette cancels through anyio, which would cancel this await too.
            with anyio.CancelScope(shield=True):
                await self._on_close()


def _raise_for_engine_failure(response: httpx.Response, key_variable: str) -> None:
    """5xx, and a refused credential: the engine's failure (or the router's setup), not the client's request."""
    if response.status_code in (401, 403):  # checked at the engine's door, before it runs anything
        raise EngineFailed(f"HTTP {response.status_code}: the engine refused the router's API key "
                           f"(${key_variable} must hold the key the engines were started with)", may_have_run=False)
    if response.status_code >= 500:
        raise EngineFailed(f"HTTP {response.status_code}: {response.text[:200]}")


def _handoff(response: httpx.Response, engine: str) -> PrefillHandoff | None:
    """The PE's hand-off; None when it has none or an unusable one: the DE gets the plain request and recomputes."""
    params = response.json().get("kv_transfer_params")
    try:
        handoff = PrefillHandoff.from_dict(params if isinstance(params, dict) else None)
    except ProtocolError as exc:  # another release or a broken engine: slower, never a wrong KV
        logger.warning("prefill engine %s answered unusable kv_transfer_params, the DE recomputes the prompt: %s",
                       engine, exc)
        return None
    if handoff is None:  # an engine without the connector
        logger.debug("prefill engine %s answered no hand-off; the DE recomputes the prompt", engine)
    return handoff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dualpath-router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="router YAML (see configs/router.yaml)")
    parser.add_argument("--host", help="override the config's host")
    parser.add_argument("--port", type=int, help="override the config's port")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    limit_malloc_arenas()  # before the tokenizer, the HTTP server and worker threads start (heap.py)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":
        # httpx logs every upstream request at INFO, scrapes included.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = load_router_config(args.config)
        if args.host:
            config.host = args.host
        if args.port:
            config.port = args.port
        router = Router(config)
    except ConfigError as exc:
        print(f"dualpath-router: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logger.info("policy %s, read side %s, %d prefill and %d decode engines, listening on %s:%d; "
                "engine API key from $%s; /metrics: %s", config.policy, config.read_side, len(config.prefill_engines),
                len(config.decode_engines), config.host, config.port, config.engine_api_key_env,
                f"bearer token from ${config.metrics_token_env}" if router.metrics_access.needs_token
                else f"loopback clients only (no ${config.metrics_token_env})")  # fmt: skip
    # Bounded: connections served at once, idle keep-alives, a request head's time and size (a slow or huge
    # header waits in h11's buffer, which this caps).
    uvicorn.run(router.build_app(), host=config.host, port=config.port, log_level=args.log_level,
                http=head_timeout_protocol(config.head_timeout_s, config.max_connections),
                limit_concurrency=config.max_connections, timeout_keep_alive=IDLE_KEEP_ALIVE_S,
                h11_max_incomplete_event_size=64 << 10)


if __name__ == "__main__":
    main()
