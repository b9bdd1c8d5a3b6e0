"""A P/D proxy as vLLM's disaggregated-serving examples write one, for NixlConnector; imports nothing of ours.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes to a prefill
engine first (round robin over ``--prefill``), with ``max_tokens`` 1, no
streaming, no ``min_tokens`` (vLLM refuses more than ``max_tokens``) and
NixlConnector's ``kv_transfer_params`` (``do_remote_decode``); the
``kv_transfer_params`` of its answer go, as they are, into the client's request
to a decode engine (round robin over ``--decode``), whose answer (streamed or
not) goes back to the client. Both engines get the client's ``Authorization``
header and one ``X-Request-Id`` (the client's, else a new one), which starts
vLLM's request id in both engines' logs. ``--de-side-channel`` adds the one
optional field dualpath-kv documents for proxies (the decoding engine's side
channel), ``--read-side`` the other; without them the proxy is exactly the
NixlConnector convention. ``--push`` is vLLM's push-mode proxy
(``toy_push_proxy_server.py``): the decode engine gets only
``do_remote_prefill``, ``do_remote_decode`` false and the prefill answer's
``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``
and ``tp_size``: no blocks, nothing else of the answer. ``--multiturn`` is
vLLM's multi-turn proxy (``disagg_proxy_multiturn.py``): a request's top-level
``conversation_id`` (taken off the body) keys the decode engine's final
``kv_transfer_params``, which the conversation's next prefill request gets
instead of NixlConnector's (``do_remote_decode`` true, ``do_remote_prefill``
false), ``remote_host`` rewritten, as there, with the host the proxy reached
that engine at. vLLM 0.32 puts them in non-streamed answers only (0.33 in the
last streamed chunk too), so only those are kept here.

    python tests/nixl_style_proxy.py --port P --prefill URL [URL ...] --decode URL [URL ...]
        [--de-side-channel H:P] [--read-side de] [--push | --multiturn]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import uuid
from urllib.parse import urlsplit

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TIMEOUT_S = 600.0
ENGINE_KEEPALIVE_EXPIRY_S = 2.0


# Sampling fields a one-token prefill must not carry: vLLM refuses a min_tokens above max_tokens.
PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens", "max_completion_tokens")
# What a push-mode proxy copies from the prefill answer's kv_transfer_params into the decode request's.
PUSH_KEPT = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


def push_params(handed: dict | None) -> dict | None:
    """The decode request's kv_transfer_params as vLLM's push-mode proxy builds them from the prefill answer's."""
    if not handed:
        return handed
    return {"do_remote_prefill": True, "do_remote_decode": False, **{key: handed.get(key) for key in PUSH_KEPT}}


def rehosted(params: dict | None, url: str) -> dict | None:
    """``params`` with ``remote_host`` the host the proxy reached that engine at (as the multi-turn proxy does)."""
    return params and {**params, "remote_host": urlsplit(url).hostname}


def app(prefills: list[str], decodes: list[str], extra_params: dict, mode: str = "pull") -> Starlette:
    # The engines' uvicorn closes an idle connection at 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), httpx keeps one 5 s
    # by default: a request sent on a connection as the engine closes it fails unanswered. Drop them first.
    client = httpx.AsyncClient(timeout=TIMEOUT_S, limits=httpx.Limits(keepalive_expiry=ENGINE_KEEPALIVE_EXPIRY_S))
    next_prefill, next_decode = itertools.cycle(prefills), itertools.cycle(decodes)
    # multiturn: conversation id -> its decode engine's last kv_transfer_params (taken once, as there).
    conversations: dict[str, dict] = {}

    def headers_of(request: Request) -> dict[str, str]:
        headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}
        if auth := request.headers.get("authorization"):
            headers["Authorization"] = auth
        return headers

    async def serve(request: Request, path: str) -> Response:
        body = await request.json()
        conversation = body.pop("conversation_id", "") if mode == "multiturn" else ""
        headers = headers_of(request)
        prefill_body = copy.deepcopy(body)
        retained = conversations.pop(conversation, None)
        if retained:
            prefill_body["kv_transfer_params"] = {**retained, "do_remote_decode": True, "do_remote_prefill": False}
        else:
            prefill_body["kv_transfer_params"] = {
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None, **extra_params,
            }  # fmt: skip
        for key in PREFILL_DROPPED:
            prefill_body.pop(key, None)
        prefill_body.update(max_tokens=1, stream=False)
        prefill = next(next_prefill)
        first = await client.post(f"{prefill}{path}", json=prefill_body, headers=headers)
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        handed = first.json().get("kv_transfer_params")
        if mode == "push":
            handed = push_params(handed)
        elif mode == "multiturn":
            handed = rehosted(handed, prefill)
        decode_body = dict(body, kv_transfer_params=handed)
        decode = next(next_decode)
        if not body.get("stream"):
            answer = await client.post(f"{decode}{path}", json=decode_body, headers=headers)
            if conversation and answer.status_code == 200 and (kept := answer.json().get("kv_transfer_params")):
                conversations[conversation] = rehosted(kept, decode)
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = client.build_request("POST", f"{decode}{path}", json=decode_body, headers=headers)
        response = await client.send(upstream, stream=True)

        async def chunks():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(chunks(), response.status_code, media_type="text/event-stream")

    async def completions(request: Request) -> Response:
        return await serve(request, "/v1/completions")

    async def chat_completions(request: Request) -> Response:
        return await serve(request, "/v1/chat/completions")

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/health", health)])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, nargs="+", help="the prefill engines' base URLs")
    parser.add_argument("--decode", required=True, nargs="+", help="the decode engines' base URLs")
    parser.add_argument("--de-side-channel", help="the decode engine's side channel (host:port)")
    parser.add_argument("--read-side", choices=("pe", "de"), help="who reads a stored hit")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--push", action="store_const", dest="mode", const="push",
                       help="decode requests as vLLM's push-mode proxy sends them")
    modes.add_argument("--multiturn", action="store_const", dest="mode", const="multiturn",
                       help="a conversation's next prefill gets its decode engine's last answer's kv_transfer_params")
    args = parser.parse_args()
    extra = {}
    if args.de_side_channel:
        extra["de_side_channel"] = args.de_side_channel
    if args.read_side:
        extra["read_side"] = args.read_side
    uvicorn.run(app(args.prefill, args.decode, extra, args.mode or "pull"), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
