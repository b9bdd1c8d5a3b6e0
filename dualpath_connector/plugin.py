"""vLLM general plugin: registers ``DualPathConnector`` with vLLM's connector factory.

vLLM calls :func:`register` in every process it starts (entry point
``vllm.general_plugins`` in ``pyproject.toml``). Registered by name, the
connector loads with ``{"kv_connector": "DualPathConnector"}`` alone, and
``MultiConnector`` can hold it as a child: MultiConnector looks its children's
stats classes up in the factory's registry by name.

It also gives this project's loggers vLLM's log format in every engine
process (below), and on vLLM's CPU build asks Linux for the AMX tile state up
front (below).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "DualPathConnector"
# The packages that log inside an engine process.
ENGINE_PACKAGES = ("dualpath_connector", "nixl_backends")
# vLLM's own line format, so an engine log reads (and greps) as one.
LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
LOG_DATE_FORMAT = "%m-%d %H:%M:%S"


def register() -> None:
    """Register the connector once; a second call (vLLM loads plugins per process, tests again) is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    configure_logging()
    _request_amx_on_cpu()
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        # The factory refuses a second registration; ours or a same-named one is already there.
        return
    # Lazy: the factory imports the module when an engine first asks for the class.
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "dualpath_connector.connector", "DualPathConnector")
    logger.debug("registered %s with vLLM's KV connector factory", CONNECTOR_NAME)


def configure_logging() -> None:
    """Our engine-side loggers print as vLLM's do, at vLLM's level, unless vLLM is told to leave logging alone.

    vLLM configures only its own ``vllm`` loggers; without this, our records
    reach Python's last-resort handler: warnings and errors only, as bare
    messages with no level or time (a grep for `` WARNING `` misses them), and
    every info record lost. ``VLLM_CONFIGURE_LOGGING=0`` (the user configures
    logging) and handlers already set (an embedding application's, on the root
    logger or ours) win; records still propagate, so a root handler added
    later sees them too.
    """
    import vllm.envs as envs

    if not envs.VLLM_CONFIGURE_LOGGING or logging.getLogger().handlers:
        return
    for name in ENGINE_PACKAGES:
        package_logger = logging.getLogger(name)
        if package_logger.handlers:
            continue
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
        package_logger.addHandler(handler)
        package_logger.setLevel(envs.VLLM_LOGGING_LEVEL)


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
