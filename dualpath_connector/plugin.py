"""vLLM general plugin: registers ``DualPathConnector`` with vLLM's connector factory.

vLLM calls :func:`register` in every process it starts (entry point
``vllm.general_plugins`` in ``pyproject.toml``). Registered by name, the
connector loads with ``{"kv_connector": "DualPathConnector"}`` alone, and
``MultiConnector`` can hold it as a child: MultiConnector looks its children's
stats classes up in the factory's registry by name.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "DualPathConnector"


def register() -> None:
    """Register the connector once; a second call (vLLM loads plugins per process, tests again) is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        # The factory refuses a second registration; ours or a same-named one is already there.
        return
    # Lazy: the factory imports the module when an engine first asks for the class.
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "dualpath_connector.connector", "DualPathConnector")
    logger.debug("registered %s with vLLM's KV connector factory", CONNECTOR_NAME)
