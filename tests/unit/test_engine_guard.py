"""The engine guard (vLLM ``--middleware``): the key on every path but the read-only probes."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from dualpath_connector.pd import engine_guard
from dualpath_connector.pd.engine_guard import KEY_ENV, EngineKeyGuard

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


@pytest.mark.parametrize(("body", "why"), [
    ({"prompt": [1], "kv_transfer_params": "do_remote_prefill"}, "kv_transfer_params must be a JSON object, got str"),
    ({"prompt": [1], "kv_transfer_params": [1]}, "kv_transfer_params must be a JSON object, got list"),
    ({"prompt": [1], "vllm_xargs": {"kv_transfer_params": "x"}}, "not in vllm_xargs"),
])
def test_kv_transfer_params_that_are_not_an_object_get_400_before_the_engine(client, body, why):
    answer = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 400 and why in answer.json()["error"]["message"]


def test_deep_nesting_gets_400_and_usable_bodies_reach_the_engine(client):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    deep = b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    answer = client.post("/v1/completions", content=deep, headers=auth)
    assert answer.status_code == 400 and "nested too deeply" in answer.json()["error"]["message"]
    # Negative controls: an object, none at all, a body that is not JSON (vLLM answers that one) all pass.
    for body in (b'{"prompt": [1], "kv_transfer_params": {"do_remote_decode": true}}', b'{"prompt": [1]}', b"{oops"):
        assert client.post("/v1/completions", content=body, headers=auth).text == "served"


def test_a_body_over_the_bound_gets_413(client, monkeypatch):
    monkeypatch.setattr(engine_guard, "MAX_BODY_BYTES", 100)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/v1/completions", json={"prompt": [1] * 100}, headers=auth).status_code == 413
    assert client.post("/v1/completions", json={"prompt": [1]}, headers=auth).text == "served"
