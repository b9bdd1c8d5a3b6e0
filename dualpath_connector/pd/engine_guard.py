"""ASGI middleware for vLLM's ``--middleware``: every engine route but health and metrics needs the engine key.

vLLM's own ``--api-key`` guards only some path prefixes (``/v1`` and a few
others); its SageMaker-style ``/invocations`` serves a completion body,
``kv_transfer_params`` included, to anyone. Behind ``dualpath-router`` only the
router may drive an engine (make a PE hold blocks, make a DE read for a PE),
so this guard demands ``Authorization: Bearer $VLLM_API_KEY`` on every path
except the read-only probes a load balancer and Prometheus use; and it refuses
with a 400 a body whose ``kv_transfer_params`` is not an object (or sits in
``vllm_xargs``) before vLLM's scheduler sees it::

    VLLM_API_KEY=... vllm serve ... --middleware dualpath_connector.EngineKeyGuard
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from typing import Any

from dualpath_connector.protocol import ProtocolError, require_object

logger = logging.getLogger(__name__)

KEY_ENV = "VLLM_API_KEY"
# Read-only probes: no request reaches the engine core through them.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
# Bodies are read whole to check them before vLLM parses them: a 128k-token prompt as JSON ids is ~1 MiB, one
# with images as base64 runs to tens of MiB.
MAX_BODY_BYTES = 64 << 20


class EngineKeyGuard:
    def __init__(self, app: Any) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            # An unguarded engine must not start quietly behind a router that trusts it.
            raise RuntimeError(f"{__name__}.EngineKeyGuard needs the engine key in ${KEY_ENV}")
        self.app = app
        self._expected = f"Bearer {key}".encode()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _refuse(send, 401, "Unauthorized", "engine key required")
            return
        if scope["type"] == "http" and scope.get("method") == "POST":
            body = await _read_body(receive, MAX_BODY_BYTES)
            if body is None:
                await _refuse(send, 413, "PayloadTooLarge", f"request body over {MAX_BODY_BYTES} bytes")
                return
            fault = kv_transfer_params_fault(body)
            if fault is not None:
                await _refuse(send, 400, "BadRequestError", fault)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


def kv_transfer_params_fault(body: bytes) -> str | None:
    """Why vLLM's scheduler must not see this request body's ``kv_transfer_params``; None if it may (including
    bodies that are not JSON: vLLM answers those itself)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    except RecursionError:
        return "request body is nested too deeply"
    if not isinstance(request, dict):
        return None
    try:
        require_object(request.get("kv_transfer_params"))
    except ProtocolError as exc:
        return str(exc)
    xargs = request.get("vllm_xargs")
    if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
        # vLLM would take it from there as a string or a list: only the body's own field is an object.
        return "kv_transfer_params goes in the request's own field, not in vllm_xargs"
    return None


async def _read_body(receive: Any, limit: int) -> bytes | None:
    """The whole request body, or None once it passes ``limit`` bytes."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)  # the client left: the app sees an empty or partial body and its disconnect
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that hands the app the body read here, then whatever the client sends next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replayed


async def _refuse(send: Any, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
