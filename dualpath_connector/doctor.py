"""``dualpath-kv doctor`` on a connector configuration: parsed by the connector's own parser.

The verdict on the configuration is the engine's (its validation, its messages naming the bad key);
then the checks only the connector knows of (the PD side channel's cluster key for producer and
consumer roles) and every storage and transport check of :mod:`nixl_backends.doctor`, which gets the
parsed target passed in and imports nothing of the connector.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dualpath_connector.config import TRANSPORT_WHERE, parse_config
from dualpath_connector.pd.cluster_auth import CLUSTER_KEY_ENV, ClusterKey
from nixl_backends.configuration import ConfigError
from nixl_backends.doctor import FAIL, OK, PD_ROLES, CheckResult, Target, diagnose_target

CONNECTOR = "DualPathConnector"


def connector_section(document: Any, kv_role: str | None) -> tuple[dict, str]:
    """The DualPathConnector's ``kv_connector_extra_config`` and role in a document: a whole
    ``--kv-transfer-config`` (also a ``MultiConnector`` holding DualPathConnector) or the extra config itself."""
    if not isinstance(document, dict):
        raise ConfigError(f"the configuration must be a JSON object, got {type(document).__name__}")
    if "kv_connector" not in document and "kv_connector_extra_config" not in document:
        return document, kv_role or "kv_both"  # the connector's extra config itself
    connector = document.get("kv_connector")
    if connector == "MultiConnector":
        children = (document.get("kv_connector_extra_config") or {}).get("connectors")
        ours = [c for c in children or () if isinstance(c, dict) and c.get("kv_connector") == CONNECTOR]
        if len(ours) != 1:
            raise ConfigError(f"MultiConnector: kv_connector_extra_config.connectors must hold one {CONNECTOR}, "
                              f"found {len(ours)}")  # fmt: skip
        return connector_section({"kv_role": document.get("kv_role"), **ours[0]}, kv_role)
    if connector != CONNECTOR:
        raise ConfigError(f"kv_connector is {connector!r}; the doctor checks {CONNECTOR} configurations")
    role = kv_role or document.get("kv_role")
    if role is None:
        raise ConfigError("missing kv_role (vLLM requires it with kv_connector): kv_both, kv_producer or kv_consumer")
    return document.get("kv_connector_extra_config") or {}, role


def parse_target(document: Any, kv_role: str | None = None) -> Target:
    """Parse as the engine would: the connector's own parser (its validation and messages)."""
    extra, role = connector_section(document, kv_role)
    config = parse_config(extra, role)
    return Target(role, config.key_prefix, config.store_config, config.transport_config, TRANSPORT_WHERE)


def check_cluster_key(target: Target) -> list[CheckResult]:
    """A PE or DE signs its side channel with the cluster key: it must be set (nothing to check otherwise)."""
    if target.kv_role not in PD_ROLES:
        return []
    try:
        ClusterKey.from_env()
    except ConfigError as exc:
        return [CheckResult("cluster key", FAIL, str(exc), f"export {CLUSTER_KEY_ENV} on every PE and DE")]
    return [CheckResult("cluster key", OK, f"{CLUSTER_KEY_ENV} is set ({target.kv_role} signs its side channel)")]


def diagnose(document: Any, *, kv_role: str | None = None,
             environ: Mapping[str, str] = os.environ) -> list[CheckResult]:  # fmt: skip
    """Every check on a ``--kv-transfer-config`` (or the connector's extra config); the results, secrets redacted."""
    return diagnose_target(document, lambda doc: parse_target(doc, kv_role), checks=check_cluster_key,
                           environ=environ)  # fmt: skip
