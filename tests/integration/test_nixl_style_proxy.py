"""tests/nixl_style_proxy.py, the P/D proxy of vLLM's examples that the e2e tests put in front of our engines,
against stand-in engines: what each engine receives (the e2e tests show that real ones serve it)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dualpath_dev.processes import free_port, stop_process_group
from tests.conftest import poll
from dualpath_connector.protocol import PrefillHandoff, RetainedDecode
from tests.integration.test_router_http import API_KEY, MODEL, PROMPT, StandInEngine

PROXY = Path(__file__).parents[1] / "nixl_style_proxy.py"


@pytest.fixture
def proxied(tmp_path):
    """Two stand-in PEs and two DEs behind the proxy; yields ``(pes, des, url)``, all stopped after."""
    with proxy_of(tmp_path) as stack:
        yield stack


@contextlib.contextmanager
def proxy_of(tmp_path, *extra: str):
    """Two stand-in PEs and two DEs behind the proxy started with ``extra``; ``(pes, des, url)``, stopped after."""
    with contextlib.ExitStack() as stack:
        pes = [StandInEngine(f"pe{i}", "prefill") for i in range(2)]
        des = [StandInEngine(f"de{i}", "decode") for i in range(2)]
        for engine in (*pes, *des):
            stack.callback(engine.stop)
        port = free_port()
        log = stack.enter_context(open(tmp_path / "proxy.log", "wb"))
        proc = subprocess.Popen([sys.executable, str(PROXY), "--port", str(port), "--prefill", *(e.url for e in pes),
                                 "--decode", *(e.url for e in des), *extra], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        stack.callback(stop_process_group, proc, 5.0)
        url = f"http://127.0.0.1:{port}"

        def health() -> int:
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code
            except httpx.HTTPError:
                assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
                return 0

        poll(health, lambda status: status == 200, 60, "the proxy's /health")
        yield pes, des, url


def test_the_proxy_sends_one_request_id_drops_min_tokens_on_the_prefill_and_takes_turns(proxied):
    pes, des, url = proxied
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "min_tokens": 3}
    for i in range(2):
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert answer.status_code == 200, answer.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
            "min_tokens": 2}  # fmt: skip
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat, headers={**auth, "X-Request-Id": "turn-3"}, timeout=30)
    assert answer.status_code == 200, answer.text
    # Round robin: the third request is the first engines' second.
    assert [len(e.received) for e in (*pes, *des)] == [2, 1, 2, 1]
    assert pes[0].paths == des[0].paths == ["/v1/completions", "/v1/chat/completions"]
    for pe, de in zip(pes, des):
        assert pe.request_ids == de.request_ids  # each request's one id, at its PE and its DE
        for prefill, decode in zip(pe.received, de.received):
            assert prefill["max_tokens"] == 1 and "min_tokens" not in prefill and "max_completion_tokens" not in prefill
            assert decode["min_tokens"] == (2 if "messages" in decode else 3)
            assert decode["kv_transfer_params"] is not None
    assert pes[0].request_ids[1] == "turn-3" and len(set(pes[0].request_ids + pes[1].request_ids)) == 3


def test_in_push_mode_the_decode_gets_only_the_pes_coordinates(tmp_path):
    """``--push`` sends what vLLM's toy_push_proxy_server.py does: our DE then claims the hold by request id."""
    with proxy_of(tmp_path, "--push") as (pes, des, url):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=30)  # fmt: skip
        assert answer.status_code == 200, answer.text
        handed = pes[0].sent_kv_transfer_params[0]
        decode = des[0].received[0]["kv_transfer_params"]
        assert decode == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
                          **{k: handed[k] for k in ("remote_request_id", "remote_host", "remote_port", "tp_size")}}
        assert PrefillHandoff.from_dict(decode) == PrefillHandoff(handed["remote_side_channel"],
                                                                  handed["remote_request_id"], None, hold_token="")


def test_in_multiturn_mode_a_conversations_next_prefill_gets_its_decodes_last_answer_once(tmp_path):
    """``--multiturn`` keeps what vLLM's disagg_proxy_multiturn.py keeps: the decode engine's final
    kv_transfer_params per conversation_id, host rewritten, handed to that conversation's next prefill once."""
    with proxy_of(tmp_path, "--multiturn") as (pes, des, url):
        retained = RetainedDecode("10.9.9.9:5700", "d-1", [4, 5], "ab" * 16, 40, [(1, "cd" * 32)])
        for de in des:
            de.decode_kv_transfer_params = retained.to_dict()
        auth = {"Authorization": f"Bearer {API_KEY}"}
        for conversation in ("c1", "c1", "c2", "c1"):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "conversation_id": conversation}
            assert httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30).status_code == 200
        prefills = [p for pe in pes for p in pe.received]
        assert all("conversation_id" not in p for p in prefills + [d for de in des for d in de.received])
        sent = [PE.get("kv_transfer_params") for PE in pes[0].received + pes[1].received]
        # Round robin: pe0 got turns 1 and 3 (the first of c1 and of c2), pe1 turns 2 and 4 (c1's next two).
        assert RetainedDecode.from_dict(sent[0]) is None and RetainedDecode.from_dict(sent[1]) is None
        for params in sent[2:]:
            assert RetainedDecode.from_dict(params) == dataclasses.replace(retained, remote_side_channel="127.0.0.1:5700")
