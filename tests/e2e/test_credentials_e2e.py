"""An engine whose S3 credentials rotate while its store throttles: a multi-turn session through three rotations.

The engine finds its credentials the way a pod does: only
``AWS_CONTAINER_CREDENTIALS_FULL_URI`` (a :class:`RotatingCredentials`
endpoint issuing a new pair every ``ROTATE_S``, each expiring ``EXPIRY_S`` after
it was issued). Its store is a verifying :class:`S3Relay` in front of SeaweedFS
that refuses any request not signed by an unexpired pair with its token. Every
turn hits the previous turns' chunks (loads) and saves its own, through NIXL
OBJ and boto3 both: no request is refused, every hit is whole, and every output
equals the engine's without the connector that served the same session from
its own prefix cache. The same relay answers a tenth of object GETs and PUTs
``503 SlowDown`` and resets a twentieth of their connections (issue 39, part 3):
the store sends those requests again after a backoff (logged and counted as
``s3_requests_retried``), so the session neither hangs nor loses a hit. The control (credentials frozen when the store opened
fail once they expire) is the integration tier's
(``tests/integration/test_rotating_credentials.py``), where it costs no engine.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from dualpath_dev.credentials_endpoint import RotatingCredentials
from dualpath_dev.s3_relay import S3Relay
from nixl_backends.layout import chunk_hashes, chunk_key
from nixl_backends.lookup import wait_stored
from tests.conftest import isolate_aws_chain, same
from tests.e2e.test_engine_e2e import CHUNK, LAYOUT, MAX_TOKENS, kv_config
from tests.vllm_engine import Engine

pytestmark = pytest.mark.engine

ROTATE_S, EXPIRY_S = 6.0, 12.0
ROTATIONS = 3
THROTTLED, RESET = 0.1, 0.05  # shares of object GETs and PUTs the relay answers 503 SlowDown / resets
# A request fails an attempt with p = 0.15: seven failed attempts in a row, 2e-6 per object, for the session's
# few hundred objects 1e-3.
IO_RETRIES = 6
BUCKET = "dualpath-rotating"
# Each turn appends two chunks to the history (the previous prompt and its output).
APPEND = 2 * CHUNK
MAX_TURNS = 30


def test_an_engine_serves_hits_and_saves_through_credential_rotations_and_throttling(tiny_model, seaweedfs,
                                                                                      plain_engine, monkeypatch):  # fmt: skip
    rng = random.Random(39)
    with contextlib.ExitStack() as stack:
        credentials = stack.enter_context(RotatingCredentials(ROTATE_S, EXPIRY_S))
        relay = stack.enter_context(S3Relay(seaweedfs.endpoint, seaweedfs.access_key, seaweedfs.secret_key,
                                            credentials, throttle_fraction=THROTTLED, reset_fraction=RESET,
                                            seed=39))  # fmt: skip
        isolate_aws_chain(monkeypatch, credentials.env)  # the engine inherits this process's environment
        config = kv_config(seaweedfs, BUCKET)
        # The engine goes through the relay.
        config["kv_connector_extra_config"]["store"].update(endpoint=relay.endpoint, io_retries=IO_RETRIES)
        # Every hit must be whole: on these cores the tiny model recomputes a hit about as fast as the relay
        # serves it, so the default (no retry past the hit's recompute time) could trade a throttled chunk for a
        # recompute, a shorter hit that is right but not what this test compares.
        config["kv_connector_extra_config"]["retries_within_recompute"] = False
        engine = stack.enter_context(Engine(tiny_model, config))
        namespace, prefix = engine.ready["namespace"], engine.ready["key_prefix"]
        # The test's own view of the bucket: SeaweedFS's static key, not through the relay.
        stored = stack.enter_context(contextlib.closing(seaweedfs.lookup_store(seaweedfs.store_config(BUCKET), LAYOUT)))
        first = credentials.issued
        history: list[int] = []
        turn = 0
        while credentials.issued < first + ROTATIONS + 1 or turn < 3:
            assert turn < MAX_TURNS, f"{credentials.issued - first} rotations in {turn} turns"
            prompt = history + [rng.randrange(1024) for _ in range(APPEND + (1 if turn == 0 else 0))]
            # The engine without the connector serves the session from its own prefix cache.
            expected = plain_engine.generate([prompt], MAX_TOKENS, reset_prefix_cache=turn == 0)[0]
            out = engine.generate([prompt], MAX_TOKENS)[0]  # its prefix cache reset: the hit comes from the store
            assert out["num_cached_tokens"] == expected["num_cached_tokens"], f"turn {turn}: hit cut short"
            assert same(out, expected), f"turn {turn} differs from the engine without the connector"
            history = prompt + out["tokens"]
            # Saves end after the answer; the next turn must find every chunk of this one.
            keys = [chunk_key(prefix, namespace, h) for h in chunk_hashes(namespace, history[:-1], CHUNK)]
            wait_stored(stored, keys, 120)
            turn += 1
        assert relay.refused_total() == 0 and relay.forwarded > 0
        log = engine.log_text()
        assert "write of" not in log and "unreadable" not in log
        assert relay.throttled >= 1 and relay.resets >= 1  # the faults happened ...
        assert "sending them again" in log  # ... and the store sent what failed again
