"""The cluster key and the signed side-channel envelope: what is accepted, and every way a frame is refused."""

from __future__ import annotations

import time

import pytest

from dualpath_connector.pd.cluster_auth import (
    CLUSTER_KEY_ENV,
    ENVELOPE_OVERHEAD,
    MAX_CLOCK_SKEW_S,
    AuthError,
    ClusterKey,
    ReplayGuard,
    open_answer,
    open_request,
    seal_answer,
    seal_request,
)
from nixl_backends.configuration import ConfigError

SECRET = "0123456789abcdef-cluster-secret"
KEY = ClusterKey(SECRET.encode())
BODY = b'{"op": "hello", "dualpath_version": 1}'


def test_the_key_comes_from_the_environment_and_never_shows():
    key = ClusterKey.from_env({CLUSTER_KEY_ENV: SECRET})
    assert SECRET not in repr(key) and SECRET not in str(key)
    frame, _ = seal_request(key, BODY)
    assert open_request(KEY, frame).body == BODY  # its UTF-8 bytes are the secret


@pytest.mark.parametrize("environ", [{}, {CLUSTER_KEY_ENV: ""}], ids=["unset", "empty"])
def test_a_missing_key_is_refused_naming_the_variable(environ):
    with pytest.raises(ConfigError, match=f"{CLUSTER_KEY_ENV} is not set"):
        ClusterKey.from_env(environ)


def test_a_short_key_is_refused_naming_the_variable_not_the_value():
    short = "hunter2-secret"  # 14 bytes
    with pytest.raises(ConfigError, match=f"{CLUSTER_KEY_ENV} is shorter than 16 bytes") as refused:
        ClusterKey.from_env({CLUSTER_KEY_ENV: short})
    assert short not in str(refused.value)
    # Negative control: 16 bytes are enough.
    ClusterKey.from_env({CLUSTER_KEY_ENV: "x" * 16})


def test_a_request_round_trips_with_a_fresh_nonce_each_time():
    (first, nonce1), (second, nonce2) = seal_request(KEY, BODY), seal_request(KEY, BODY)
    assert nonce1 != nonce2 and first != second
    opened = open_request(KEY, first)
    assert (opened.body, opened.nonce) == (BODY, nonce1)
    assert abs(opened.sent_at - time.time()) < 5


def test_an_answer_opens_only_for_its_request():
    _, nonce = seal_request(KEY, BODY)
    _, other_nonce = seal_request(KEY, BODY)
    answer = seal_answer(KEY, b'{"agent": "pe"}', nonce)
    assert open_answer(KEY, answer, nonce) == b'{"agent": "pe"}'
    with pytest.raises(AuthError, match="to another request"):
        open_answer(KEY, answer, other_nonce)


def test_a_request_and_an_answer_cannot_stand_in_for_each_other():
    request, nonce = seal_request(KEY, BODY)
    with pytest.raises(AuthError, match="a request where an answer was expected"):
        open_answer(KEY, request, bytes(16))  # a request reflected back carries reply_to zeros
    with pytest.raises(AuthError, match="an answer where a request was expected"):
        open_request(KEY, seal_answer(KEY, BODY, nonce))


def test_a_wrong_key_is_refused():
    frame, _ = seal_request(ClusterKey(b"another-cluster-secret"), BODY)
    with pytest.raises(AuthError, match=f"bad signature.*{CLUSTER_KEY_ENV}"):
        open_request(KEY, frame)


def test_any_tampered_byte_is_refused():
    frame, _ = seal_request(KEY, BODY)
    for i in range(len(frame)):
        tampered = bytearray(frame)
        tampered[i] ^= 0x01
        with pytest.raises(AuthError):
            open_request(KEY, bytes(tampered))
    # An added byte too.
    with pytest.raises(AuthError, match="bad signature"):
        open_request(KEY, frame + b" ")


def test_every_truncation_is_refused():
    frame, _ = seal_request(KEY, BODY)
    for length in range(len(frame)):
        with pytest.raises(AuthError):
            open_request(KEY, frame[:length])
    assert open_request(KEY, frame).body == BODY  # negative control: the whole frame


@pytest.mark.parametrize("frame", [BODY, b"", b"DPSC", b"\x00" * 200], ids=["old-json", "empty", "magic-only", "zeros"])
def test_a_frame_without_an_envelope_names_an_older_release(frame):
    with pytest.raises(AuthError, match="older dualpath-kv release, or not a cluster member"):
        open_request(KEY, frame)


def test_another_envelope_version_is_named():
    frame, _ = seal_request(KEY, BODY)
    with pytest.raises(AuthError, match="envelope version 2, this side speaks 1"):
        open_request(KEY, frame[:4] + b"\x02" + frame[5:])


@pytest.mark.parametrize("skew", [-MAX_CLOCK_SKEW_S - 5, MAX_CLOCK_SKEW_S + 5], ids=["stale", "future"])
def test_a_message_beyond_the_clock_skew_is_refused(skew):
    now = time.time()
    frame, nonce = seal_request(KEY, BODY, now=now + skew)
    with pytest.raises(AuthError, match="from this engine's clock"):
        open_request(KEY, frame, now=now)
    with pytest.raises(AuthError, match="from this engine's clock"):
        open_answer(KEY, seal_answer(KEY, BODY, nonce, now=now + skew), nonce, now=now)
    # Negative control: inside the bound it opens.
    inside, _ = seal_request(KEY, BODY, now=now + skew * 0.9)
    assert open_request(KEY, inside, now=now).body == BODY


def test_a_stale_frame_is_refused_before_its_mac_is_computed(monkeypatch):
    """A flood of old or forged-stamp frames (up to 16 MiB each) costs no MAC over their bodies."""
    now = time.time()
    stale, _ = seal_request(KEY, b"x" * (1 << 20), now=now - MAX_CLOCK_SKEW_S - 5)
    macs: list[int] = []
    real_mac = ClusterKey.mac
    monkeypatch.setattr(ClusterKey, "mac", lambda self, data: macs.append(len(data)) or real_mac(self, data))
    with pytest.raises(AuthError, match="from this engine's clock"):
        open_request(KEY, stale, now=now)
    assert macs == []
    # Control: a fresh frame is MACed (once) and opens.
    fresh, _ = seal_request(KEY, BODY, now=now)
    macs.clear()
    assert open_request(KEY, fresh, now=now).body == BODY and len(macs) == 1


def test_a_replayed_request_is_refused():
    guard = ReplayGuard()
    frame, _ = seal_request(KEY, BODY)
    guard.check(open_request(KEY, frame))
    with pytest.raises(AuthError, match="replayed"):
        guard.check(open_request(KEY, frame))
    # Negative control: the same body in a new envelope is a new request.
    guard.check(open_request(KEY, seal_request(KEY, BODY)[0]))


def test_the_replay_guard_forgets_nonces_past_the_window():
    guard = ReplayGuard(window_s=MAX_CLOCK_SKEW_S)
    now = time.time()
    for offset in (0.0, 1.0, 2.0):
        guard.check(open_request(KEY, seal_request(KEY, BODY, now=now + offset)[0], now=now), now=now)
    assert len(guard) == 3
    guard.check(open_request(KEY, seal_request(KEY, BODY, now=now + 61.5)[0], now=now + 61.5), now=now + 61.5)
    assert len(guard) == 2  # the two stamped before now + 1.5 are stale by now: forgotten


def test_a_clock_stepping_back_does_not_reopen_forgotten_nonces():
    guard = ReplayGuard(window_s=MAX_CLOCK_SKEW_S)
    now = time.time()
    first, _ = seal_request(KEY, BODY, now=now)
    guard.check(open_request(KEY, first, now=now), now=now)
    guard.check(open_request(KEY, seal_request(KEY, BODY, now=now + 61)[0], now=now + 61), now=now + 61)
    assert len(guard) == 1  # the first nonce is forgotten
    # This host's clock steps back 30 s: the first request is fresh again by the clock, but refused.
    replayed = open_request(KEY, first, now=now + 31)
    with pytest.raises(AuthError, match="older than the nonces"):
        guard.check(replayed, now=now + 31)


def test_a_full_replay_guard_never_lets_a_forgotten_nonce_back_in():
    guard = ReplayGuard(capacity=3)
    now = time.time()
    frames = [seal_request(KEY, BODY, now=now + i)[0] for i in range(5)]
    for frame in frames[:4]:
        guard.check(open_request(KEY, frame, now=now), now=now)
    assert len(guard) == 3
    # The oldest was forgotten to stay bounded; replaying it is still refused.
    with pytest.raises(AuthError, match="older than the nonces"):
        guard.check(open_request(KEY, frames[0], now=now), now=now)
    # Negative control: a newer request is served.
    guard.check(open_request(KEY, frames[4], now=now), now=now)


def test_the_envelope_overhead_is_fixed():
    assert len(seal_request(KEY, BODY)[0]) == ENVELOPE_OVERHEAD + len(BODY)
