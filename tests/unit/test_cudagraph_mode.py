"""vLLM's own config resolution turns full CUDA graphs into PIECEWISE where our connector waits per layer.

A step replayed as one full graph skips ``wait_for_layer_load``, so attention could read blocks before their
KV arrived. vLLM asks the connector class (``requires_piecewise_for_cudagraph``) while it resolves its
config. The CPU build resolves no graphs at all, so the platform is made to look like a GPU's in two places
(a fake, because no CUDA runtime runs here): it supports static graphs, and its own config hook, which on the
CPU turns graphs off, leaves the mode alone. Everything else is vLLM's ``VllmConfig``.
"""

from __future__ import annotations

from unittest import mock

import pytest
from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.platforms import current_platform

STORE = {"backend": "posix", "root": "/nonexistent"}  # never opened: only the config is resolved


def resolved_mode(extra_config: dict | None) -> CUDAGraphMode:
    kv = None
    if extra_config is not None:
        kv = KVTransferConfig(kv_connector="DualPathConnector", kv_connector_module_path="dualpath_connector",
                              kv_role="kv_both", kv_connector_extra_config=extra_config)  # fmt: skip
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    platform = type(current_platform)
    with (
        mock.patch.object(platform, "support_static_graph_mode", return_value=True),
        mock.patch.object(platform, "check_and_update_config"),
    ):
        return VllmConfig(compilation_config=compilation, kv_transfer_config=kv).compilation_config.cudagraph_mode


@pytest.mark.parametrize("extra", [{"store": STORE}, {"store": STORE, "load_mode": "layerwise"}],
                         ids=["default", "layerwise"])  # fmt: skip
def test_layerwise_loads_get_piecewise_graphs(extra):
    assert resolved_mode(extra) == CUDAGraphMode.PIECEWISE


def test_bulk_loads_keep_full_graphs():
    """Bulk loads land before the forward: nothing waits per layer, so the full graphs stay."""
    assert resolved_mode({"store": STORE, "load_mode": "bulk"}) == CUDAGraphMode.FULL_AND_PIECEWISE


def test_without_a_connector_the_fake_platform_keeps_full_graphs():
    """Negative control: the PIECEWISE above is the connector's doing, not the fake platform's."""
    assert resolved_mode(None) == CUDAGraphMode.FULL_AND_PIECEWISE


def test_an_unknown_mode_counts_as_waiting():
    """vLLM asks before the connector validates its config (which refuses the value at start-up)."""
    from dualpath_connector.config import waits_per_layer

    assert waits_per_layer({"store": STORE, "load_mode": "sideways"})
