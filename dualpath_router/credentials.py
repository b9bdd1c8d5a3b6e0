"""The router's credential towards its engines: the API key they were started with.

Engines accept only requests carrying it (vLLM's ``--api-key``, or its
``VLLM_API_KEY`` environment variable, guards every ``/v1`` path), so no
client can reach an engine past the router and drive ``kv_transfer_params``
itself (make a PE hold blocks, make a DE read for a fake PE). The key comes
from the environment only; the config names the variable. It never appears
in a log, an error message or a repr.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
from collections.abc import Mapping

from nixl_backends.configuration import ConfigError

DEFAULT_ENGINE_API_KEY_ENV = "DUALPATH_ENGINE_API_KEY"
DEFAULT_METRICS_TOKEN_ENV = "DUALPATH_ROUTER_METRICS_TOKEN"

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EngineCredential:
    """A bearer token for the engines' OpenAI servers."""

    __slots__ = ("_key",)

    def __init__(self, key: str) -> None:
        self._key = key

    @classmethod
    def from_env(cls, variable: str, environ: Mapping[str, str] = os.environ) -> EngineCredential:
        key = environ.get(variable)
        if not key:
            raise ConfigError(
                f"the engines' API key is missing: set the environment variable {variable} to the key the "
                "engines were started with (vLLM --api-key or VLLM_API_KEY); the config key "
                "`engine_api_key_env` names another variable"
            )
        if any(c.isspace() or not c.isprintable() for c in key):
            # An HTTP header cannot carry them; the value itself stays out of the message.
            raise ConfigError(f"the environment variable {variable} holds whitespace or control characters; "
                              "an API key cannot")
        return cls(key)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}"}

    def __repr__(self) -> str:
        return "EngineCredential(<redacted>)"


class MetricsAccess:
    """Who may read the router's /metrics: holders of the token in ``variable``, or, with none set, loopback
    clients only (a Prometheus beside the router, or one reaching it through a port-forward)."""

    __slots__ = ("_expected",)

    def __init__(self, variable: str, environ: Mapping[str, str] = os.environ) -> None:
        token = environ.get(variable, "")
        self._expected = f"Bearer {token}".encode() if token else None

    @property
    def needs_token(self) -> bool:
        return self._expected is not None

    def refusal(self, client_host: str | None, authorization: str | None) -> int | None:
        """None when the scrape may read; else the status to answer (401: token wrong or absent; 403: not
        loopback and no token configured)."""
        if self._expected is not None:
            given = (authorization or "").encode()
            return None if hmac.compare_digest(given, self._expected) else 401
        try:
            return None if client_host is not None and ipaddress.ip_address(client_host).is_loopback else 403
        except ValueError:  # not an address (a Unix socket, a test client)
            return 403

    def __repr__(self) -> str:
        return f"MetricsAccess(needs_token={self.needs_token})"
