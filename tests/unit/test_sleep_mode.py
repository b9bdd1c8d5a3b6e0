"""vLLM 0.33's sleep mode: the connector refuses it in every role, with the reason in the log.

vLLM 0.33 asks ``supports_sleep_mode(kv_transfer_config)`` before ``--enable-sleep-mode`` and refuses the
engine when it is False (a wake-up remaps the KV cache, which the worker's views and NIXL registration would
still name). The CPU build here is 0.32, which never asks: the classmethod is checked directly, as 0.33 calls it,
and against 0.32's base class, which must not gain an abstract method from it.
"""

from __future__ import annotations

import logging

import pytest
from vllm.config import KVTransferConfig

from dualpath_connector.connector import DualPathConnector


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_sleep_mode_is_refused_with_the_reason(role, caplog):
    config = KVTransferConfig(kv_connector="DualPathConnector", kv_role=role)
    with caplog.at_level(logging.WARNING, logger="dualpath_connector.connector"):
        assert DualPathConnector.supports_sleep_mode(config) is False
    assert "does not support vLLM's sleep mode" in caplog.text and "--enable-sleep-mode" in caplog.text


def test_the_connector_stays_concrete():
    assert not getattr(DualPathConnector, "__abstractmethods__", frozenset())
