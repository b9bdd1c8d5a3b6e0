"""`make demo` in small: examples/disagg_demo.sh brings up SeaweedFS, a PE, a DE and the router,
two agents run three turns, both read sides serve hits, and everything stops afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dualpath_connector.devstack import S3_SECRET_KEY
from tests.conftest import REPO_ROOT

# Known failure, kept runnable: on vLLM's CPU workers the DE's NIXL READ of the
# PE's blocks sometimes stays in flight past pd_transfer_timeout_s while the DE
# worker's main thread stalls (vLLM reports no shm broadcast read for 60 s), so
# the prompt is recomputed and outputs differ. See issue 3's closing note.
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        os.environ.get("DUALPATH_RUN_PD_E2E") != "1",
        reason="PD pull stalls on vLLM CPU workers (issue 3 open); set DUALPATH_RUN_PD_E2E=1 to run",
    ),
]


def test_disagg_demo_uses_both_read_sides(tmp_path, tiny_model):
    (tmp_path / "tiny-llama").symlink_to(tiny_model)
    args = ["--workdir", str(tmp_path), "--turns", "3", "--first-prompt-tokens", "600",
            "--tokens-per-turn", "100", "--output-tokens", "8"]  # fmt: skip
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "examples" / "disagg_demo.sh"), *args],
        capture_output=True, text=True, timeout=1800, env=env, start_new_session=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    turns = re.findall(r"agent (\d) turn +(\d): +(\d+) prompt tokens, read side +(\w+), +(\d+) hit tokens", done.stdout)
    assert len(turns) == 6
    assert all(int(hit) == 0 for _, turn, _, _, hit in turns if turn == "1")
    assert all(int(hit) > 0 for _, turn, _, _, hit in turns if turn != "1")
    assert "read sides used for hits: de, pe" in done.stdout
    logs = [p for p in tmp_path.iterdir() if p.suffix == ".log"]
    assert logs and not any(S3_SECRET_KEY in p.read_text(errors="replace") for p in logs)
