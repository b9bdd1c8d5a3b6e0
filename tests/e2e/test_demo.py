"""`make demo` in small: the OpenAI server with the connector, hits growing turn by turn."""

from __future__ import annotations

import pytest

from dualpath_dev.s3_server import S3_SECRET_KEY
from tests.conftest import load_example

pytestmark = pytest.mark.engine

CHUNK = 32


demo = load_example("demo_single")


def test_demo_hits_grow_and_metrics_and_logs_are_right(tmp_path, tiny_model):
    (tmp_path / "tiny-llama").symlink_to(tiny_model)
    result = demo.run(tmp_path, turns=3, first_prompt_tokens=600, tokens_per_turn=100, output_tokens=8)
    turns = result["turns"]
    assert turns[0]["hit_tokens"] == 0
    for previous, current in zip(turns, turns[1:]):
        # Every full chunk of what the previous turn computed (its prompt and
        # output but the last token) comes from the store: the local prefix
        # cache is off.
        computed = previous["prompt_tokens"] + 8 - 1
        assert current["hit_tokens"] == computed // CHUNK * CHUNK
    # Connector counters reach vLLM's /metrics.
    assert result["bytes_read"] > 0 and result["bytes_written"] > 0
    # Turns 2 and 3 each injected their hit layer by layer in (at least) one forward, and said how long it waited.
    stall = result["layer_stall"]
    assert stall["wait_seconds_count"] >= turns[-1]["turn"] - 1 and stall["load_seconds_sum"] > 0
    # Credentials went through the environment: the secret is in no log line.
    assert S3_SECRET_KEY not in result["log"].read_text()
