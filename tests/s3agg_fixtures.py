"""Fixtures and helpers of the s3agg tests: a bucket of chunk objects, gateway processes, client stores."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import pytest
from botocore.exceptions import ClientError

from nixl_backends.layout import BlockLayout
from nixl_backends.registry import make_store, parse_store_config
from dualpath_dev.gateway import GatewayProcess, gateway_config

CLIENT_ACCESS_KEY = "s3agg-client"
CLIENT_SECRET_KEY = "s3agg-client-secret-do-not-log"
THETA = 64 * 1024  # small, so tests exercise both modes with small payloads


@pytest.fixture(scope="module")
def s3agg_server(seaweedfs):
    """The S3 server behind the module's gateways; a module overrides it to run on another server."""
    return seaweedfs


@pytest.fixture(scope="module")
def s3agg_bucket(s3agg_server):
    """A bucket for the module, emptied and deleted afterwards (SeaweedFS has room for few buckets)."""
    name = f"agg-{uuid.uuid4().hex[:12]}"
    client = s3agg_server.client()
    client.create_bucket(Bucket=name)
    yield name
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])
        client.delete_bucket(Bucket=name)
    except ClientError:
        pass


@pytest.fixture(scope="module")
def start_gateway(s3agg_server, s3agg_bucket, tmp_path_factory) -> Callable[..., GatewayProcess]:
    """Start gateways with config overrides; all are stopped when the module ends, also on failure."""
    started: list[GatewayProcess] = []
    workdir = tmp_path_factory.mktemp("gateway")

    def start(**overrides) -> GatewayProcess:
        config = gateway_config(s3agg_server, s3agg_bucket, CLIENT_ACCESS_KEY, CLIENT_SECRET_KEY,
                                **{"theta_bytes": THETA, "io_threads": 4, "io_timeout_s": 20.0, **overrides})
        gateway = GatewayProcess(config, workdir)
        started.append(gateway)
        return gateway.start()

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="module")
def gateway(start_gateway) -> GatewayProcess:
    return start_gateway()


def open_store(server, bucket: str, gateway_url: str, layout: BlockLayout, agent, **overrides):
    """An ``s3agg`` store, parsed from config exactly as a user would write it."""
    config = parse_store_config({
        "backend": "s3agg",
        "gateway": gateway_url,
        "s3": {**server.store_config(bucket), "create_bucket": False},
        "access_key": CLIENT_ACCESS_KEY,
        "secret_key": CLIENT_SECRET_KEY,
        "request_timeout_s": 30.0,
        **overrides,
    })
    return make_store(config, layout, agent)


class LayerBuffers:
    """``L`` layer regions of ``N*S`` bytes in one NIXL-registered array, filled with a sentinel."""

    SENTINEL = 0xA5

    def __init__(self, agent, num_layers: int, num_chunks: int, layer_bytes: int) -> None:
        self.array = np.full((num_layers, num_chunks * layer_bytes), self.SENTINEL, dtype=np.uint8)
        self.addrs = [self.array.ctypes.data + layer * self.array.shape[1] for layer in range(num_layers)]
        self._agent = agent
        self._registration = agent.register_memory([(self.array.ctypes.data, self.array.nbytes, 0, "")], "DRAM")

    def untouched(self) -> bool:
        return bool((self.array == self.SENTINEL).all())

    def close(self) -> None:
        self._agent.deregister_memory(self._registration)
