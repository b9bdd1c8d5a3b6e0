"""The router's credential towards its engines: the API key they were started with.

Engines accept only requests carrying it (vLLM's ``--api-key``, or its
``VLLM_API_KEY`` environment variable, guards every ``/v1`` path), so no
client can reach an engine past the router and drive ``kv_transfer_params``
itself (make a PE hold blocks, make a DE read for a fake PE). The key comes
from the environment only; the config names the variable. It never appears
in a log, an error message or a repr.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from nixl_backends.configuration import ConfigError

DEFAULT_ENGINE_API_KEY_ENV = "DUALPATH_ENGINE_API_KEY"

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
