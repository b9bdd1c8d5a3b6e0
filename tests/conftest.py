"""Shared fixtures: a real SeaweedFS on 127.0.0.1, the tiny test Llama, NIXL agents.

Everything a fixture starts it stops in its finalizer, by the PID it holds.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import uuid
from pathlib import Path

import pytest

from dualpath_dev.seaweedfs import SeaweedFS
from dualpath_dev.tiny_model import make_tiny_llama

REPO_ROOT = Path(__file__).resolve().parent.parent
_agent_names = itertools.count()


def load_example(name: str):
    """A script of ``examples/`` as a module (examples are not installed packages)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", REPO_ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(seaweedfs) -> str:
    """A fresh bucket name per test (the store creates it)."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random Llama, made once per checkout (seeded, so always the same weights)."""
    return make_tiny_llama(REPO_ROOT / ".cache" / "tiny-llama")


@pytest.fixture
def nixl_agent():
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"test-{os.getpid()}-{next(_agent_names)}", nixl_agent_config(backends=[]))
    yield agent
