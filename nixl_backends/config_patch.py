"""One config file for every container, per-container values from the environment: a JSON merge patch.

``DUALPATH_CONFIG_PATCH`` holds a JSON merge patch (RFC 7396): an object whose
members replace the config's (objects merge member by member, ``null`` removes
a member, anything else, lists included, replaces). The image's entrypoint
applies it to the service's config file before the service reads it, so a
compose file or a Kubernetes pod spec sets what differs per container (a side
channel's host name, the store's address) and mounts the shared file as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from nixl_backends.configuration import ConfigError

PATCH_ENV = "DUALPATH_CONFIG_PATCH"


def merge_patch(target: Any, patch: Any) -> Any:
    """``target`` with RFC 7396's merge ``patch`` applied (neither is changed)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = merge_patch(merged.get(name), value)
    return merged


def parse_patch(text: str) -> dict[str, Any]:
    """The patch in ``text``: a JSON object, or a ConfigError naming ``DUALPATH_CONFIG_PATCH``."""
    try:
        patch = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{PATCH_ENV}: not JSON ({exc})") from None
    if not isinstance(patch, dict):
        raise ConfigError(f"{PATCH_ENV}: a JSON merge patch must be an object, got {type(patch).__name__}")
    return patch


def patched_config_text(path: str | os.PathLike[str], patch_text: str) -> str:
    """The config file at ``path`` (JSON, or YAML for any other suffix) with the patch applied, as the same format."""
    path = Path(path)
    patch = parse_patch(patch_text)
    is_json = path.suffix == ".json"
    text = path.read_text()
    try:
        config = json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot parse it ({exc})") from None
    merged = merge_patch(config, patch)
    return json.dumps(merged, indent=2) + "\n" if is_json else yaml.safe_dump(merged, sort_keys=False)
