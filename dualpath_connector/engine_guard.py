"""ASGI middleware for vLLM's ``--middleware``: every engine route but health and metrics needs the engine key.

vLLM's own ``--api-key`` guards only some path prefixes (``/v1`` and a few
others); its SageMaker-style ``/invocations`` serves a completion body,
``kv_transfer_params`` included, to anyone. Behind ``dualpath-router`` only the
router may drive an engine (make a PE hold blocks, make a DE read for a PE),
so this guard demands ``Authorization: Bearer $VLLM_API_KEY`` on every path
except the read-only probes a load balancer and Prometheus use::

    VLLM_API_KEY=... vllm serve ... --middleware dualpath_connector.engine_guard.EngineKeyGuard
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

KEY_ENV = "VLLM_API_KEY"
# Read-only probes: no request reaches the engine core through them.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


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
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": {"message": "engine key required", "type": "Unauthorized", "code": 401}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
