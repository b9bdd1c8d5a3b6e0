"""benchmarks/_common.py's process helpers keep their shapes: a decorator once slid from vllm_stack onto
start_side_by_side, so every bench built on vllm_stack failed at once and start_side_by_side started nothing."""

from __future__ import annotations

import contextlib
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _common  # noqa: E402


def test_vllm_stack_is_a_context_manager_and_start_side_by_side_runs_at_once():
    stack = _common.vllm_stack(SimpleNamespace(), "stem", {})
    assert isinstance(stack, contextlib.AbstractContextManager)  # not entered: nothing is started
    assert not inspect.isgeneratorfunction(_common.start_side_by_side)
    started = []
    server = SimpleNamespace(start=lambda timeout_s: started.append(timeout_s))
    _common.start_side_by_side([server, server], 5.0)
    assert started == [5.0, 5.0]
