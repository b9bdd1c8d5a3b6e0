"""A P/D proxy as vLLM's disaggregated-serving examples write one, for NixlConnector; imports nothing of ours.

Each ``/v1/completions`` request goes to the prefill engine first, with
``max_tokens`` 1, no streaming and NixlConnector's ``kv_transfer_params``
(``do_remote_decode``); the ``kv_transfer_params`` of its answer go, as they
are, into the client's request to the decode engine, whose answer (streamed
or not) goes back to the client. The client's ``Authorization`` header goes to
both engines. ``--de-side-channel`` adds the one optional field dualpath-kv
documents for proxies (the decoding engine's side channel), ``--read-side``
the other; without them the proxy is exactly the NixlConnector convention.

    python tests/nixl_style_proxy.py --port P --prefill URL --decode URL [--de-side-channel H:P] [--read-side de]
"""

from __future__ import annotations

import argparse
import copy

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TIMEOUT_S = 600.0


def app(prefill: str, decode: str, extra_params: dict) -> Starlette:
    client = httpx.AsyncClient(timeout=TIMEOUT_S)

    def headers_of(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    async def completions(request: Request) -> Response:
        body = await request.json()
        prefill_body = copy.deepcopy(body)
        prefill_body["kv_transfer_params"] = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None, **extra_params,
        }  # fmt: skip
        prefill_body.update(max_tokens=1, stream=False)
        prefill_body.pop("stream_options", None)
        first = await client.post(f"{prefill}/v1/completions", json=prefill_body, headers=headers_of(request))
        if first.status_code != 200:
            return Response(first.content, first.status_code, media_type="application/json")
        decode_body = dict(body, kv_transfer_params=first.json().get("kv_transfer_params"))
        if not body.get("stream"):
            answer = await client.post(f"{decode}/v1/completions", json=decode_body, headers=headers_of(request))
            return Response(answer.content, answer.status_code, media_type="application/json")
        upstream = client.build_request("POST", f"{decode}/v1/completions", json=decode_body, headers=headers_of(request))
        response = await client.send(upstream, stream=True)

        async def chunks():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(chunks(), response.status_code, media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="the prefill engine's base URL")
    parser.add_argument("--decode", required=True, help="the decode engine's base URL")
    parser.add_argument("--de-side-channel", help="the decode engine's side channel (host:port)")
    parser.add_argument("--read-side", choices=("pe", "de"), help="who reads a stored hit")
    args = parser.parse_args()
    extra = {}
    if args.de_side_channel:
        extra["de_side_channel"] = args.de_side_channel
    if args.read_side:
        extra["read_side"] = args.read_side
    uvicorn.run(app(args.prefill, args.decode, extra), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
