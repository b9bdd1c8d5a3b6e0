"""The engine/router/bench contract: messages round trip, hostile input is refused, one parser, one key space.

Also the leading-run lookups every side shares (``nixl_backends.lookup``),
against a fake store that records what it was asked.
"""

from __future__ import annotations

import pytest

from nixl_backends.layout import BlockLayout, chunk_hashes, chunk_key
from nixl_backends.lookup import PresentChunks, wait_stored

from dualpath_connector.protocol import (
    NAMESPACE_INFO_METRIC,
    PROTOCOL_VERSION,
    VERSION_KEY,
    PrefillHandoff,
    RetainedDecode,
    PrefillRequest,
    ProtocolError,
    ReadAnswer,
    ReadRequest,
    StoreKeySpace,
    counter_total_name,
    ReleaseHold,
    ClaimHold,
    HoldClaim,
    metric_total,
    metric_totals,
    new_hold_token,
    new_keep_token,
    parse_pulled,
    pulled_notification,
)

KEY_SPACE = StoreKeySpace(digest="0123abcd" * 4, key_prefix="dualpath", chunk_tokens=32, num_layers=4,
                          layer_block_bytes=1024)  # fmt: skip
HOLD = "7e" * 16
HANDOFF = PrefillHandoff("10.0.0.1:5600", "cmpl-1", [3, 1, 2], stored_chunks=2, hold_token=HOLD)
KEPT = PrefillHandoff("10.0.0.1:5600", "cmpl-1", [3, 1, 2], 2, kept_token="0f" * 16, kept_first_chunk=1, kept_chunks=4,
                      hold_token=HOLD)  # fmt: skip


# -- kv_transfer_params ----------------------------------------------------------


@pytest.mark.parametrize("request_", [PrefillRequest(), PrefillRequest("pe"), PrefillRequest("de", "10.0.0.2:5700")])
def test_prefill_request_round_trips(request_):
    params = request_.to_dict()
    assert params["do_remote_decode"] is True and params[VERSION_KEY] == PROTOCOL_VERSION
    assert PrefillRequest.from_dict(params) == request_


def test_prefill_request_names_the_decoding_de_for_either_read_side():
    # With read side "pe" it is where the PE may move a read while its own link is busy.
    assert PrefillRequest.from_dict(PrefillRequest("pe", "10.0.0.2:5700").to_dict()) == PrefillRequest("pe", "10.0.0.2:5700")
    assert PrefillRequest.from_dict(PrefillRequest("pe").to_dict()) == PrefillRequest("pe")


def test_prefill_handoff_round_trips():
    params = HANDOFF.to_dict()
    assert params["do_remote_prefill"] is True and params[VERSION_KEY] == PROTOCOL_VERSION
    assert PrefillHandoff.from_dict(params) == HANDOFF
    assert PrefillHandoff.from_dict({**params, "stored_chunks": 0}).stored_chunks == 0


def test_a_handoff_names_the_pe_tensor_parallel_size_one_when_absent():
    sharded = PrefillHandoff("10.0.0.1:5600", "cmpl-1", [3, 1, 2], tp_size=4, hold_token=HOLD)
    assert PrefillHandoff.from_dict(sharded.to_dict()) == sharded
    older = {k: v for k, v in HANDOFF.to_dict().items() if k != "tp_size"}
    assert PrefillHandoff.from_dict(older).tp_size == 1
    for bad in (0, -2, "2", True, None):
        with pytest.raises(ProtocolError, match="tp_size"):
            PrefillHandoff.from_dict({**HANDOFF.to_dict(), "tp_size": bad})


def test_a_handoff_carries_nixl_connectors_address_keys_and_a_rewritten_host_wins():
    """P/D proxies copy ``remote_host``/``remote_port`` (vLLM's multi-turn proxy rewrites the host with the
    address it reached the PE at): the DE reaches the PE there."""
    params = HANDOFF.to_dict()
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.1", 5600)
    assert PrefillHandoff.from_dict({**params, "remote_host": "pe-0.svc"}).remote_side_channel == "pe-0.svc:5600"
    # Our own key alone (a proxy that dropped NixlConnector's) still names it.
    only_ours = {k: v for k, v in params.items() if k not in ("remote_host", "remote_port")}
    assert PrefillHandoff.from_dict(only_ours) == HANDOFF


# What vLLM's push-mode proxy (toy_push_proxy_server.py) sends a DE, built from our PE's answer.
PUSH = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
        "remote_request_id": "cmpl-1", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2}  # fmt: skip


def test_a_push_mode_proxys_handoff_is_a_push_handoff_to_claim_by_request_id():
    handoff = PrefillHandoff.from_dict(PUSH)
    assert handoff == PrefillHandoff("10.0.0.1:5600", "cmpl-1", None, tp_size=2, hold_token="")
    assert handoff.push and not HANDOFF.push
    # Whatever else rides along, a push hand-off keeps no kept hit (its token came with the blocks).
    assert PrefillHandoff.from_dict({**PUSH, "kept_token": "0f" * 16, "kept_chunks": 2}).kept_token is None
    assert PrefillHandoff.from_dict(handoff.to_dict()) == handoff
    with pytest.raises(ProtocolError, match="version"):
        PrefillHandoff.from_dict({**PUSH, VERSION_KEY: PROTOCOL_VERSION + 1})
    for change, what in (({"remote_request_id": None}, "remote_request_id"), ({"remote_host": None}, "remote_host"),
                         ({"remote_port": None}, "remote_port"), ({"tp_size": 0}, "tp_size")):  # fmt: skip
        with pytest.raises(ProtocolError, match=what):
            PrefillHandoff.from_dict({**PUSH, **change})


RETAINED = RetainedDecode("10.0.0.2:5700", "cmpl-d1", [4, 9, 2], HOLD, 95, [(2, "ab" * 32), (1, "cd" * 32)], tp_size=2)


def test_a_retained_decode_round_trips_and_reads_as_a_prefill_request_too():
    params = RETAINED.to_dict()
    assert RetainedDecode.from_dict(params) == RETAINED
    # What the multi-turn proxy sends the next PE: the DE's answer, do_remote_decode true; also a prefill request.
    assert PrefillRequest.from_dict(params) == PrefillRequest("pe")
    assert RetainedDecode.from_dict(NIXL_PROXY_PREFILL) is None and RetainedDecode.from_dict(HANDOFF.to_dict()) is None


@pytest.mark.parametrize(
    "change, what",
    [({"retained_checkpoints": []}, "retained_checkpoints"), ({"retained_checkpoints": "ab"}, "retained_checkpoints"),
     ({"retained_checkpoints": [[1, "ab"]] * 5}, "retained_checkpoints"),
     ({"retained_checkpoints": [[0, "ab"]]}, "chunks"), ({"retained_checkpoints": [[1, "AB"]]}, "hashes"),
     ({"retained_checkpoints": [[1, "ab", 3]]}, "retained_checkpoints"), ({"retained_tokens": -1}, "retained_tokens"),
     ({"hold_token": None}, "hold_token"), ({"remote_block_ids": [1, -1]}, "remote_block_ids"),
     ({VERSION_KEY: 1}, "version")],
)  # fmt: skip
def test_bad_retained_decodes_are_refused(change, what):
    with pytest.raises(ProtocolError, match=what):
        RetainedDecode.from_dict({**RETAINED.to_dict(), **change})


def test_a_handoff_needs_its_hold_token():
    """What ends the PE's hold: without it a DE could not release the blocks, so such a hand-off is refused."""
    for bad in (None, "", "not hex", "AB" * 16, "a" * 65, 7):
        with pytest.raises(ProtocolError, match="hold_token"):
            PrefillHandoff.from_dict({**HANDOFF.to_dict(), "hold_token": bad})
    assert new_hold_token() != new_hold_token() and len(new_hold_token()) == 32


def test_pulled_notifications_carry_the_request_and_its_hold_token():
    assert parse_pulled(pulled_notification("cmpl-1:odd:id", HOLD)) == ("cmpl-1:odd:id", HOLD)
    for bad in (b"pulled:cmpl-1", b"pulled::" + HOLD.encode(), b"pulled:cmpl-1:XYZ", b"pulled:\xff:" + HOLD.encode()):
        assert parse_pulled(bad) is None


def test_a_release_hold_message_round_trips_and_bad_ones_are_refused():
    message = ReleaseHold("cmpl-1", HOLD).to_message()
    assert ReleaseHold.from_message(message) == ReleaseHold("cmpl-1", HOLD)
    for change, what in (({"hold_token": "zz"}, "hold_token"), ({"remote_request_id": ""}, "remote_request_id"),
                         ({VERSION_KEY: 1}, "version")):  # fmt: skip
        with pytest.raises(ProtocolError, match=what):
            ReleaseHold.from_message({**message, **change})


def test_a_claim_and_its_answer_round_trip_and_bad_ones_are_refused():
    message = ClaimHold("cmpl-1", HOLD).to_message()
    assert message["op"] == "claim_hold" and ClaimHold.from_message(message) == ClaimHold("cmpl-1", HOLD)
    with pytest.raises(ProtocolError, match="hold_token"):
        ClaimHold.from_message({**message, "hold_token": "zz"})
    # A push hand-off's claim has no token (a release must have one); its answer names the blocks.
    assert ClaimHold.from_message(ClaimHold("cmpl-1", "").to_message()) == ClaimHold("cmpl-1", "")
    for bad in (None, 7):
        with pytest.raises(ProtocolError, match="hold_token"):
            ClaimHold.from_message({**message, "hold_token": bad})
    with pytest.raises(ProtocolError, match="hold_token"):
        ReleaseHold.from_message(ReleaseHold("cmpl-1", "").to_message())
    granted = HoldClaim(new_hold_token(), 30.0)
    assert HoldClaim.from_message(granted.to_message()) == granted
    named = HoldClaim(new_hold_token(), 30.0, [7, 3, 9])
    assert HoldClaim.from_message(named.to_message()) == named
    with pytest.raises(ProtocolError, match="remote_block_ids"):
        HoldClaim.from_message({**named.to_message(), "remote_block_ids": [1, -1]})
    for change, what in (({"claim_token": "zz"}, "claim_token"), ({"claim_s": float("nan")}, "claim_s"),
                         ({"claim_s": 1e999}, "claim_s"), ({"claim_s": 0}, "claim_s"), ({"claim_s": "30"}, "claim_s")):
        with pytest.raises(ProtocolError, match=what):
            HoldClaim.from_message({**granted.to_message(), **change})


def test_a_handoff_naming_a_kept_hit_round_trips():
    assert PrefillHandoff.from_dict(KEPT.to_dict()) == KEPT
    # Without a token the range means nothing and is dropped.
    params = {**HANDOFF.to_dict(), "kept_first_chunk": 5, "kept_chunks": 9}
    assert PrefillHandoff.from_dict(params) == HANDOFF


@pytest.mark.parametrize(
    "change, what",
    [({"kept_token": ""}, "kept_token"), ({"kept_token": "ZZ"}, "kept_token"), ({"kept_token": "a" * 65}, "kept_token"),
     ({"kept_token": 7}, "kept_token"), ({"kept_token": "../x"}, "kept_token"), ({"kept_chunks": -1}, "kept_chunks"),
     ({"kept_chunks": True}, "kept_chunks"), ({"kept_first_chunk": 1.5}, "kept_first_chunk")],
)  # fmt: skip
def test_bad_kept_hits_in_a_handoff_are_refused(change, what):
    with pytest.raises(ProtocolError, match=what):
        PrefillHandoff.from_dict({**KEPT.to_dict(), **change})


def test_new_keep_tokens_are_valid_and_distinct():
    tokens = {new_keep_token() for _ in range(100)}
    assert len(tokens) == 100
    assert all(PrefillHandoff.from_dict({**HANDOFF.to_dict(), "kept_token": t}).kept_token == t for t in tokens)


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, {"do_remote_decode": False}])
def test_params_without_the_flag_are_none(params):
    assert PrefillRequest.from_dict(params) is None
    assert PrefillHandoff.from_dict(params) is None


# vLLM reads kv_transfer_params from vllm_xargs too, whose values may be strings or lists: before this check a
# string reached params.get() in the scheduler (AttributeError on vLLM's scheduler thread).
@pytest.mark.parametrize("params", ["do_remote_prefill", ["do_remote_decode"], 1, True])
def test_params_that_are_not_an_object_are_refused(params):
    for message in (PrefillRequest, PrefillHandoff):
        with pytest.raises(ProtocolError, match="kv_transfer_params must be a JSON object"):
            message.from_dict(params)


@pytest.mark.parametrize("message", [PrefillRequest().to_dict(), HANDOFF.to_dict()])
@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, "1", None])
def test_another_or_missing_version_is_refused_naming_both(message, version):
    parse = PrefillRequest.from_dict if "do_remote_decode" in message else PrefillHandoff.from_dict
    with pytest.raises(ProtocolError) as info:
        parse({**message, VERSION_KEY: version})
    assert f"version {version!r}" in str(info.value) and f"speaks {PROTOCOL_VERSION}" in str(info.value)


def test_a_handoff_without_a_version_is_refused():
    """Only our PE writes hand-offs (a proxy forwards them as they are): one without a version is not ours."""
    without = {k: v for k, v in HANDOFF.to_dict().items() if k != VERSION_KEY}
    with pytest.raises(ProtocolError, match="version None"):
        PrefillHandoff.from_dict(without)


# What vLLM's P/D proxy examples (and llm-d's sidecar) send a prefill engine under NixlConnector's convention.
NIXL_PROXY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def test_a_prefill_request_in_nixl_connector_convention_is_a_pe_side_read():
    assert PrefillRequest.from_dict(NIXL_PROXY_PREFILL) == PrefillRequest("pe", None)
    # The one optional field a proxy may add to name the decoding DE (enables DE-side and moved reads).
    named = {**NIXL_PROXY_PREFILL, "de_side_channel": "10.0.0.2:5700"}
    assert PrefillRequest.from_dict(named) == PrefillRequest("pe", "10.0.0.2:5700")
    assert PrefillRequest.from_dict({**named, "read_side": "de"}) == PrefillRequest("de", "10.0.0.2:5700")
    # The same checks as for the router's form: a DE read without a side channel, a bad side.
    with pytest.raises(ProtocolError, match="de_side_channel"):
        PrefillRequest.from_dict({**NIXL_PROXY_PREFILL, "read_side": "de"})
    with pytest.raises(ProtocolError, match="read_side"):
        PrefillRequest.from_dict({**NIXL_PROXY_PREFILL, "read_side": "both"})


@pytest.mark.parametrize(
    "change, what",
    [
        ({"read_side": "x"}, "read_side"),
        ({"read_side": "de", "de_side_channel": None}, "de_side_channel"),
        ({"read_side": "de", "de_side_channel": ""}, "de_side_channel"),
        ({"read_side": "de", "de_side_channel": 5700}, "de_side_channel"),
        ({"read_side": "pe", "de_side_channel": ""}, "de_side_channel"),
        ({"read_side": "pe", "de_side_channel": ["h:1"]}, "de_side_channel"),
    ],
)
def test_bad_prefill_requests_are_refused(change, what):
    with pytest.raises(ProtocolError, match=what):
        PrefillRequest.from_dict({**PrefillRequest().to_dict(), **change})


def test_a_de_read_without_a_side_channel_key_is_refused():
    params = {k: v for k, v in PrefillRequest("de", "10.0.0.2:5700").to_dict().items() if k != "de_side_channel"}
    with pytest.raises(ProtocolError, match="de_side_channel"):
        PrefillRequest.from_dict(params)


@pytest.mark.parametrize(
    "change, what",
    [
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"remote_block_ids": [1, 2.0]}, "remote_block_ids"),
        ({"remote_block_ids": [1, True]}, "remote_block_ids"),
        ({"remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"stored_chunks": True}, "stored_chunks"),
        ({"stored_chunks": -1}, "stored_chunks"),
        ({"stored_chunks": "2"}, "stored_chunks"),
        ({"remote_side_channel": "", "remote_host": None, "remote_port": None}, "remote_side_channel"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_host": None}, "remote_host"),
        ({"remote_port": None}, "remote_port"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": 65536}, "remote_port"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"remote_port": True}, "remote_port"),
        ({"remote_request_id": None}, "remote_request_id"),
    ],
)
def test_bad_handoffs_are_refused(change, what):
    with pytest.raises(ProtocolError, match=what):
        PrefillHandoff.from_dict({**HANDOFF.to_dict(), **change})


# -- side-channel messages ---------------------------------------------------------


@pytest.mark.parametrize("keep_token", [None, "1f" * 16])
def test_read_request_round_trips(keep_token):
    request = ReadRequest(KEY_SPACE.digest, ["ab" * 32, "cd" * 32], 2.5, keep_token)
    assert ReadRequest.from_message(request.to_message()) == request


@pytest.mark.parametrize(
    "change, what",
    [({"chunk_hashes": "ab"}, "chunk_hashes"), ({"chunk_hashes": [1]}, "chunk_hashes"),
     ({"deadline_s": 0}, "deadline_s"), ({"deadline_s": True}, "deadline_s"), ({"deadline_s": "1"}, "deadline_s"),
     ({"deadline_s": float("inf")}, "deadline_s"), ({"deadline_s": float("nan")}, "deadline_s"),
     ({"keep_token": ""}, "keep_token"), ({"keep_token": ["ab"]}, "keep_token"), ({"keep_token": "A1"}, "keep_token")],
)  # fmt: skip
def test_bad_read_requests_are_refused(change, what):
    message = ReadRequest(KEY_SPACE.digest, ["ab" * 32], 2.5).to_message()
    with pytest.raises(ProtocolError, match=what):
        ReadRequest.from_message({**message, **change})


def test_read_answer_round_trips():
    answer = ReadAnswer(2, "lease-7", [4096, 8192], 1 << 20, 119.5)
    assert ReadAnswer.from_message(answer.to_message(), asked=3) == answer
    declined = ReadAnswer(0, None, [])
    assert ReadAnswer.from_message(declined.to_message(), asked=3) == declined


@pytest.mark.parametrize(
    "message, what",
    [
        ({"readable": 4, "lease": "l", "chunk_addrs": [1, 2, 3, 4]}, "readable"),  # more than asked
        ({"readable": -1, "lease": None, "chunk_addrs": []}, "readable"),
        ({"readable": True, "lease": "l", "chunk_addrs": [1]}, "readable"),
        ({"readable": 2, "lease": "l", "chunk_addrs": [1]}, "one address per readable chunk"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [1, 2]}, "one address per readable chunk"),
        ({"readable": 1, "lease": None, "chunk_addrs": [1]}, "lease"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [-1]}, "chunk_addrs"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [1]}, "layer_stride"),  # a read chunk needs its stride
        ({"readable": 1, "lease": "l", "chunk_addrs": [1], "layer_stride": 0}, "layer_stride"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [1], "layer_stride": True}, "layer_stride"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [1], "layer_stride": 1 << 60}, "layer_stride"),
        # A lent buffer needs the time its lease has left, a finite one.
        ({"readable": 1, "lease": "l", "chunk_addrs": [1], "layer_stride": 8}, "lease_s"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [1], "layer_stride": 8, "lease_s": float("nan")}, "lease_s"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [1], "layer_stride": 8, "lease_s": float("inf")}, "lease_s"),
        ({"readable": 1, "lease": "l", "chunk_addrs": [1], "layer_stride": 8, "lease_s": -1}, "lease_s"),
    ],
)
def test_bad_read_answers_are_refused(message, what):
    with pytest.raises(ProtocolError, match=what):
        ReadAnswer.from_message(message, asked=3)


# -- metrics -------------------------------------------------------------------------

METRICS = f"""# HELP vllm:num_requests_running Running requests
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} 2.0
vllm:num_requests_running{{engine="1",model_name="m"}} 3.0
# TYPE dualpath_kv:bytes_read counter
dualpath_kv:bytes_read_total{{engine="0"}} 1024.0
dualpath_kv:bytes_read_total{{engine="1"}} 512.0
# TYPE {NAMESPACE_INFO_METRIC} gauge
{NAMESPACE_INFO_METRIC}{{{",".join(f'{k}="{v}"' for k, v in KEY_SPACE.to_labels().items())},engine="0"}} 1.0
"""


def test_metric_totals_sum_over_label_sets():
    totals = metric_totals(METRICS)
    assert totals["vllm:num_requests_running"] == 5.0
    assert totals[counter_total_name("bytes_read")] == 1536.0
    assert metric_total(METRICS, counter_total_name("bytes_read")) == 1536.0
    assert metric_total(METRICS, counter_total_name("bytes_written")) == 0.0


def test_counter_names_carry_the_prefix_and_total():
    assert counter_total_name("bytes_read") == "dualpath_kv:bytes_read_total"


# -- the store key space ----------------------------------------------------------------


def test_key_space_labels_round_trip():
    labels = KEY_SPACE.to_labels()
    assert labels["namespace"] == KEY_SPACE.digest and labels["chunk_tokens"] == "32"
    assert StoreKeySpace.from_labels(labels) == KEY_SPACE
    # Engines add their own labels (engine, model_name): ignored.
    assert StoreKeySpace.from_labels({**labels, "engine": "0", "model_name": "m"}) == KEY_SPACE


@pytest.mark.parametrize(
    "change, what",
    [
        ({"namespace": "XYZ"}, "digest"),  # a tampered label: the negative control of the round trip
        ({"namespace": ""}, "digest"),
        ({"chunk_tokens": "0"}, "chunk_tokens"),
        ({"num_layers": "-4"}, "num_layers"),
        ({"layer_block_bytes": "many"}, "malformed"),
        ({"key_prefix": None}, "malformed"),  # dropped below
    ],
)
def test_bad_labels_are_refused(change, what):
    labels = {**KEY_SPACE.to_labels(), **change}
    labels = {k: v for k, v in labels.items() if v is not None}
    with pytest.raises(ProtocolError, match=what):
        StoreKeySpace.from_labels(labels)


def test_key_space_from_metrics():
    assert StoreKeySpace.from_metrics(METRICS) == KEY_SPACE
    without = "\n".join(line for line in METRICS.splitlines() if NAMESPACE_INFO_METRIC not in line) + "\n"
    with pytest.raises(ProtocolError, match="DualPathConnector"):
        StoreKeySpace.from_metrics(without)


def test_layout_and_keys():
    assert KEY_SPACE.layout == BlockLayout(4, 1024)
    tokens = list(range(1000, 1000 + 3 * 32 + 5))
    expected = [chunk_key("dualpath", KEY_SPACE.digest, h) for h in chunk_hashes(KEY_SPACE.digest, tokens, 32)]
    assert len(expected) == 3  # full chunks only
    assert KEY_SPACE.chunk_keys(tokens) == expected
    assert KEY_SPACE.key(chunk_hashes(KEY_SPACE.digest, tokens, 32)[0]) == expected[0]


@pytest.mark.parametrize("tokens, claimable", [(1, 0), (32, 0), (33, 1), (64, 1), (65, 2), (96, 2), (97, 3)])
def test_claimable_keys_never_cover_the_last_token(tokens, claimable):
    token_ids = list(range(500, 500 + tokens))
    keys = KEY_SPACE.claimable_keys(token_ids)
    assert len(keys) == claimable
    assert keys == KEY_SPACE.chunk_keys(token_ids)[:claimable]


# -- leading-run lookups ------------------------------------------------------------------


class FakeStore:
    """``lookup`` answers from a set of present keys and records every call."""

    def __init__(self, present: set[str]) -> None:
        self.present = present
        self.calls: list[list[str]] = []

    def lookup(self, keys) -> int:
        self.calls.append(list(keys))
        run = 0
        while run < len(keys) and keys[run] in self.present:
            run += 1
        return run


KEYS = [f"k{i}" for i in range(6)]


def test_present_chunks_is_a_leading_run_asked_only_past_what_it_remembers():
    store = FakeStore(set(KEYS[:3]) | {KEYS[4]})  # a gap at 3: the run ends there
    present = PresentChunks(capacity=100)
    assert present.leading_present(store, KEYS) == 3
    assert store.calls == [KEYS]
    assert present.known_run(KEYS) == 3
    store.present.add(KEYS[3])
    assert present.leading_present(store, KEYS) == 5
    assert store.calls[-1] == KEYS[3:]  # the remembered run is not asked again
    # All remembered: no store round trip.
    assert present.leading_present(store, KEYS[:5]) == 5
    assert len(store.calls) == 2


def test_present_chunks_never_remembers_a_miss():
    store = FakeStore(set())
    present = PresentChunks(capacity=100)
    assert present.leading_present(store, KEYS) == 0
    store.present.update(KEYS)
    assert present.leading_present(store, KEYS) == len(KEYS)


def test_present_chunks_evicts_the_least_recently_used_past_capacity():
    present = PresentChunks(capacity=3)
    present.remember(KEYS[:3])
    assert present.known_run(KEYS[:1]) == 1  # k0 used: k1 is now the oldest
    present.remember(KEYS[3:4])
    assert present.known_run([KEYS[0]]) == 1 and present.known_run([KEYS[3]]) == 1
    assert present.known_run([KEYS[1]]) == 0


def test_present_chunks_forget():
    present = PresentChunks(capacity=10)
    present.remember(KEYS[:4])
    present.forget([KEYS[1]])
    assert present.known_run(KEYS) == 1
    with pytest.raises(ValueError):
        PresentChunks(capacity=0)


def test_wait_stored_returns_once_every_key_is_present():
    store = FakeStore(set(KEYS[:-1]))
    original = store.lookup

    def saves_land(keys) -> int:  # the last chunk lands after the first look
        found = original(keys)
        store.present.add(KEYS[-1])
        return found

    store.lookup = saves_land
    wait_stored(store, KEYS, timeout_s=5.0, poll_s=0.001)
    assert store.calls[0][0] == KEYS[-1]  # the last key (the last saved) is asked first
    assert len(store.calls) == 2
    wait_stored(store, [], timeout_s=0.01)  # nothing to wait for


def test_wait_stored_names_the_missing_key():
    store = FakeStore(set(KEYS) - {KEYS[2]})
    with pytest.raises(TimeoutError, match=f"chunk {KEYS[2]} not stored within 0.01s"):
        wait_stored(store, KEYS, timeout_s=0.01, poll_s=0.001)
