"""`make demo` in small: examples/disagg_demo.sh brings up SeaweedFS, a PE, a DE and the router; a
streaming chat through the openai client (examples/chat_client.py) gets text and hits from its second
turn, two agents run three turns, both read sides serve hits, and everything stops afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dualpath_dev.s3_server import S3_SECRET_KEY
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.engine


def test_disagg_demo_chats_and_uses_both_read_sides(tmp_path, tiny_model):
    (tmp_path / "tiny-llama").symlink_to(tiny_model)
    args = ["--workdir", str(tmp_path), "--turns", "3", "--first-prompt-tokens", "600",
            "--tokens-per-turn", "100", "--output-tokens", "8", "--chat-turns", "3"]  # fmt: skip
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "examples" / "disagg_demo.sh"), *args],
        capture_output=True, text=True, timeout=1800, env=env, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    # The chat: every turn streamed non-empty text; from turn 2 on the prompt starts
    # with turn 1's (the chat template keeps earlier messages' tokens), so the store serves hits.
    chat = re.findall(r"\[turn (\d): (\d+) streamed chunks, (\d+) characters, read side (\w+|\?), (\d+) hit tokens\]",
                      done.stdout)
    assert [int(turn) for turn, *_ in chat] == [1, 2, 3], done.stdout[-5000:]
    # Every turn has text; a loaded engine may send a whole answer in one event (vLLM joins the tokens its
    # client has not taken yet), but over the chat the answers arrived in more events than turns.
    assert all(int(characters) > 0 for _, _, characters, _, _ in chat), (chat, done.stdout[-3000:])
    assert sum(int(chunks) for _, chunks, _, _, _ in chat) > len(chat), (chat, done.stdout[-3000:])
    assert [int(hit) > 0 for *_, hit in chat] == [False, True, True]
    assert all(side in ("pe", "de") for _, _, _, side, _ in chat)
    assert "random weights" in done.stdout
    turns = re.findall(r"agent (\d) turn +(\d): +(\d+) prompt tokens, read side +(\w+), +(\d+) hit tokens", done.stdout)
    assert len(turns) == 6
    assert all(int(hit) == 0 for _, turn, _, _, hit in turns if turn == "1")
    assert all(int(hit) > 0 for _, turn, _, _, hit in turns if turn != "1")
    assert "read sides used for hits: de, pe" in done.stdout
    logs = [p for p in tmp_path.iterdir() if p.suffix == ".log"]
    assert logs and not any(S3_SECRET_KEY in p.read_text(errors="replace") for p in logs)
