"""scripts/gpu_connector_check.py's CPU self-test: the GPU script's code runs (and can fail) without a GPU."""

from __future__ import annotations

import importlib.util
import json

import torch

from dualpath_connector.cache.device_copies import DeviceCopier
from dualpath_dev import kv_layouts
from tests.conftest import REPO_ROOT


def _script():
    spec = importlib.util.spec_from_file_location("gpu_connector_check", REPO_ROOT / "scripts" / "gpu_connector_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_self_test_checks_every_layout_and_times_every_mode(tmp_path):
    assert _script().main(["--device", "cpu", "--quick", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_connector.json").read_text())
    assert {c["layout"] for c in result["layouts"]} == set(kv_layouts.LAYOUTS)
    assert all(c["ok"] and c["negative_control"] for c in result["layouts"])
    assert set(result["overlap"]["modes"]) == {"no-load", "bulk", "layerwise", "layerwise-per-block", "bulk-layer-major",
                                              "layerwise-layer-major"}
    assert "| layerwise |" in (tmp_path / "gpu_connector.md").read_text()


def test_a_copy_that_does_not_happen_fails_the_byte_check(monkeypatch):
    """Negative control: saves that copy nothing must fail the check (and so the exit status)."""
    monkeypatch.setattr(DeviceCopier, "post_saves", lambda self, plan: self.stream.mark())
    check = _script().check_layout("LBHNC", torch.device("cpu"))
    assert not check["stored"] and not check["ok"]


def test_without_a_gpu_cuda_mode_says_so():
    if torch.cuda.is_available():
        return
    assert _script().main(["--device", "cuda"]) == 77
