"""dualpath-kv's vLLM KV connector.

Load it with ``--kv-transfer-config '{"kv_connector": "DualPathConnector",
"kv_connector_module_path": "dualpath_connector", ...}'``. Importing this
package is cheap and touches no device: vLLM imports it in the API-server
process too; each name below is only resolved on first access.

The names users type in vLLM's command line live here, so they stay put when the modules behind them
move: ``--middleware dualpath_connector.EngineKeyGuard`` and ``--scheduler-cls
dualpath_connector.QuotaScheduler`` (``AsyncQuotaScheduler`` on engines with async scheduling).
"""

import importlib
from typing import Any

# Public name -> the module that defines it.
_PUBLIC = {
    "DualPathConnector": "dualpath_connector.connector",
    "EngineKeyGuard": "dualpath_connector.pd.engine_guard",
    "QuotaScheduler": "dualpath_connector.scheduler.compute_quota",
    "AsyncQuotaScheduler": "dualpath_connector.scheduler.compute_quota",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'dualpath_connector' has no attribute {name!r}")
