"""The engine guard (vLLM ``--middleware``): the key on every path but the read-only probes."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from dualpath_connector.engine_guard import KEY_ENV, EngineKeyGuard

KEY = "k" * 32


def _app() -> Starlette:
    async def ok(request):
        return PlainTextResponse("served")

    paths = ["/v1/completions", "/invocations", "/health", "/metrics", "/anything/else"]
    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(EngineKeyGuard)
    return app


@pytest.fixture
def client(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    with TestClient(_app()) as made:
        yield made


@pytest.mark.parametrize("path", ["/v1/completions", "/invocations", "/anything/else"])
def test_every_serving_path_needs_the_key(client, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
        answer = client.post(path, json={}, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == 401
    # Negative control: the key opens it.
    assert client.post(path, json={}, headers={"Authorization": f"Bearer {KEY}"}).text == "served"


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_probes_stay_open(client, path):
    assert client.get(path).text == "served"


def test_an_engine_without_a_key_does_not_start(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=KEY_ENV):
        with TestClient(_app()):
            pass
