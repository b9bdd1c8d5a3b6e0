"""Every GPU script's CPU self-test, in a fresh interpreter where ``vllm`` cannot be imported.

A device machine has torch with CUDA and no vLLM (``scripts/device_check.sh`` runs there), so
the scripts and everything they import must work without it; here an import hook refuses
``vllm`` before the script starts, and each self-test must pass (or, for the device-only
parts, say why it cannot run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

# Runs the script after making every import of vllm fail.
_NO_VLLM = """
import importlib.abc, runpy, sys
class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("vllm is not installed on a device machine (made unimportable by the test)")
sys.meta_path.insert(0, NoVllm())
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def _run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", _NO_VLLM, str(REPO_ROOT / "scripts" / script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)  # fmt: skip


def test_the_import_hook_refuses_vllm():
    """Control: the hook really makes vllm unimportable (vllm is installed here)."""
    done = subprocess.run([sys.executable, "-c", _NO_VLLM.replace("script = sys.argv[1]", "import vllm")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "vllm is not installed on a device machine" in done.stderr


def test_connector_check_runs_without_vllm(tmp_path):
    done = _run("gpu_connector_check.py", "--device", "cpu", "--quick", "--mma", "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_connector.json").read_text())
    assert all(c["ok"] and c["layer_major"]["ok"] for c in result["layouts"])
    copies = result["overlap"]["h2d_copies"]
    # The quick hit is 7 chunks in consecutive slots: 7 copies per layer chunk-major, one layer-major.
    assert copies["chunk-major"]["per_layer"] == 7 and copies["layer-major"]["per_layer"] == 1
    assert copies["layer-major"]["bytes_each"] == [7 * copies["chunk-major"]["bytes_each"][0]]
    assert "overlap_mma" in result


def test_gds_check_runs_without_vllm_and_names_why_gds_cannot_start(tmp_path):
    out = tmp_path / "gds.json"
    done = _run("gpu_gds_check.py", "--device", "cpu", "--dir", str(tmp_path), "--json", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["plugins"]["posix+h2d"]["byte_exact"]
    assert "GDS" in result["plugins"]["GDS"]["refused"]
    assert list(tmp_path.iterdir()) == [out]  # its chunk files are gone


def test_nixl_check_runs_without_vllm():
    done = _run("gpu_nixl_check.py", "--device", "cpu", "--mib", "4", "--reps", "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "gpu_nixl_check: PASS" in done.stdout


def test_device_check_says_when_there_is_no_gpu(tmp_path):
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "device_check.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert done.returncode == 77 and "no usable GPU" in done.stdout


def test_mma_rows_are_refused_without_the_library(tmp_path, monkeypatch):
    """--mma never silently measures native copies: without libmma_preload.so it stops and says so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_connector_check", REPO_ROOT / "scripts" / "gpu_connector_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "MMA_LIBRARY", tmp_path / "libmma_preload.so")
    with pytest.raises(SystemExit, match="libmma_preload.so is missing"):
        module.measure_under_mma([], tmp_path)
