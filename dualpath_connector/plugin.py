"""vLLM general plugin: registers ``DualPathConnector`` with vLLM's connector factory.

vLLM calls :func:`register` in every process it starts (entry point
``vllm.general_plugins`` in ``pyproject.toml``). Registered by name, the
connector loads with ``{"kv_connector": "DualPathConnector"}`` alone, and
``MultiConnector`` can hold it as a child: MultiConnector looks its children's
stats classes up in the factory's registry by name.

On vLLM's CPU build it also asks Linux for the AMX tile state up front (below).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "DualPathConnector"


def register() -> None:
    """Register the connector once; a second call (vLLM loads plugins per process, tests again) is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    _request_amx_on_cpu()
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        # The factory refuses a second registration; ours or a same-named one is already there.
        return
    # Lazy: the factory imports the module when an engine first asks for the class.
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "dualpath_connector.connector", "DualPathConnector")
    logger.debug("registered %s with vLLM's KV connector factory", CONNECTOR_NAME)


def _request_amx_on_cpu() -> None:
    """On CPU, ask Linux for the AMX tile state before any kernel uses it.

    Linux hands a process AMX tile data only after ``arch_prctl(ARCH_REQ_XCOMP_PERM)``;
    vLLM's CPU attention kernel uses AMX tiles without asking, and a process
    whose first AMX instruction is that kernel dies of SIGILL. A prefill-only
    engine survives (oneDNN's GEMMs ask first), but a PD decode engine's first
    forward is a one-token decode of KV it pulled: attention first. The request
    is per process and harmless where AMX is absent (torch answers False).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch

    if torch._C._cpu._init_amx():
        logger.debug("AMX tile state granted to this process")
