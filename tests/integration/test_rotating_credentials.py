"""An ``s3`` store whose credentials come from the AWS chain's container endpoint and rotate while it runs.

A :class:`RotatingCredentials` endpoint (``AWS_CONTAINER_CREDENTIALS_FULL_URI``)
issues a new key pair every ``ROTATE_S`` that expires ``EXPIRY_S`` after it was
issued; a verifying :class:`S3Relay` in front of SeaweedFS accepts only requests
signed by an unexpired pair with its token. The store (NIXL OBJ for payloads,
boto3 for lookups) writes, looks up and reads chunks, byte-equal, through at
least three rotations. The control opens NIXL OBJ as the store did before:
with the chain's credentials of the moment, frozen; once they expire, the
relay refuses it and transfers fail.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from dualpath_dev.credentials_endpoint import RotatingCredentials
from dualpath_dev.s3_relay import S3Relay
from nixl_backends.buffers import HostBufferPool
from nixl_backends.nixl_io import descriptors, run_nixl_transfers
from nixl_backends.obj_backend import OBJ, ensure_obj_plugin_loadable, obj_device_ids
from nixl_backends.registry import make_store, parse_store_config
from nixl_backends.s3_endpoint import s3_session
from tests.conftest import isolate_aws_chain, poll
from tests.integration.test_stores import FULL, LAYOUT, addrs, fill_random, make_keys, poison

ROTATE_S, EXPIRY_S = 2.0, 4.0
ROTATIONS = 3
PATIENT_S = 60.0


@pytest.fixture
def rotating(seaweedfs, monkeypatch):
    """This process's AWS chain finds only the rotating endpoint; the relay in front of SeaweedFS checks it."""
    credentials = RotatingCredentials(ROTATE_S, EXPIRY_S).start()
    relay = S3Relay(seaweedfs.endpoint, seaweedfs.access_key, seaweedfs.secret_key, credentials).start()
    try:
        isolate_aws_chain(monkeypatch, credentials.env)
        yield credentials, relay
    finally:
        relay.stop()
        credentials.stop()


def _config(relay: S3Relay, bucket: str) -> dict:
    """An ``s3`` section without keys: the credentials come from the chain."""
    return {"backend": "s3", "bucket": bucket, "endpoint": relay.endpoint}


def test_a_store_on_the_chain_keeps_working_through_rotations(rotating, s3_bucket, nixl_agent):
    credentials, relay = rotating
    store = make_store(parse_store_config(_config(relay, s3_bucket)), LAYOUT, nixl_agent)
    pool = HostBufferPool(nixl_agent, FULL, 4)
    rng = np.random.default_rng(39)
    try:
        first = credentials.issued
        deadline = time.monotonic() + PATIENT_S
        rounds = 0
        # Work without pause until the endpoint has issued ROTATIONS more pairs (and the last one was used).
        while credentials.issued < first + ROTATIONS + 1 or rounds < 2:
            assert time.monotonic() < deadline, f"{credentials.issued - first} rotations in {PATIENT_S}s"
            keys = make_keys(rng, 2)
            fill_random(pool, [0, 1], rng)
            assert store.write(keys, addrs(pool, [0, 1])) == [True, True], f"write in round {rounds}"
            assert store.lookup(keys) == 2
            poison(pool, [2, 3])
            assert store.read(keys, addrs(pool, [2, 3])) == [True, True], f"read in round {rounds}"
            assert all(np.array_equal(pool.slot_view(a), pool.slot_view(b)) for a, b in ((0, 2), (1, 3)))
            rounds += 1
        assert relay.refused_total() == 0 and relay.forwarded > 0
    finally:
        pool.close()
        store.close()


def test_control_credentials_frozen_at_open_fail_once_they_expire(rotating, s3_bucket, nixl_agent):
    """NIXL OBJ opened as add_obj_backend did before: with the chain's pair of the moment, token and all."""
    credentials, relay = rotating
    section = parse_store_config(_config(relay, s3_bucket))
    make_store(section, LAYOUT, None).close()  # the bucket, created through the relay (no agent: lookups only)
    frozen = s3_session(section).get_credentials().get_frozen_credentials()
    ensure_obj_plugin_loadable()
    nixl_agent.create_backend(OBJ, {
        "bucket": s3_bucket, "region": section.region, "endpoint_override": relay.endpoint, "scheme": "http",
        "use_virtual_addressing": "false", "req_checksum": "required", "resp_checksum": "required",
        "access_key": frozen.access_key, "secret_key": frozen.secret_key, "session_token": frozen.token})  # fmt: skip
    pool = HostBufferPool(nixl_agent, FULL, 1)
    rng = np.random.default_rng(40)
    try:
        fill_random(pool, [0], rng)
        assert _obj_write(nixl_agent, pool, make_keys(rng, 1)[0])  # while the pair lives
        poll(lambda: credentials.secret_for(frozen.access_key, frozen.token), lambda secret: secret is None,
             PATIENT_S, "the frozen pair's expiry")  # fmt: skip
        assert not _obj_write(nixl_agent, pool, make_keys(rng, 1)[0])
        assert relay.refused.get("ExpiredToken", 0) >= 1
    finally:
        pool.close()


def _obj_write(agent, pool: HostBufferPool, key: str) -> bool:
    """One PUT of slot 0 as ``key`` through the agent's OBJ backend."""
    (dev_id,) = obj_device_ids(agent, 1)
    registration = agent.register_memory([(0, FULL, dev_id, key)], OBJ)
    try:
        (ok,) = run_nixl_transfers(agent, "WRITE", [(descriptors(pool.slot_addr(0), FULL), descriptors(0, FULL, dev_id))],
                                   OBJ, 30.0)  # fmt: skip
        return ok
    finally:
        agent.deregister_memory(registration)
