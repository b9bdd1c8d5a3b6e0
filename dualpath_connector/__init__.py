"""dualpath-kv's vLLM KV connector.

Load it with ``--kv-transfer-config '{"kv_connector": "DualPathConnector",
"kv_connector_module_path": "dualpath_connector", ...}'``. Importing this
package is cheap and touches no device: vLLM imports it in the API-server
process too; the connector class is only resolved on first access.
"""

from typing import Any

__all__ = ["DualPathConnector"]


def __getattr__(name: str) -> Any:
    if name == "DualPathConnector":
        from dualpath_connector.connector import DualPathConnector

        return DualPathConnector
    raise AttributeError(f"module 'dualpath_connector' has no attribute {name!r}")
