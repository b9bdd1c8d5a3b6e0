"""The store registry: backend name -> (config dataclass, store class), resolved lazily.

Backends import :mod:`nixl_backends.store` (the interface); this module names
them by module path only and imports one when it is asked for, so there is no
import cycle and opening a POSIX store never imports boto3.
"""

from __future__ import annotations

import importlib
from typing import Any

from nixl_backends.configuration import ConfigError, from_dict
from nixl_backends.layout import BlockLayout
from nixl_backends.store import KVStore

# name -> (module, config class, store class)
_BACKENDS: dict[str, tuple[str, str, str]] = {
    "dualblade": ("nixl_backends.dualblade", "DualBladeStoreConfig", "DualBladeStore"),
    "posix": ("nixl_backends.posix", "PosixStoreConfig", "PosixStore"),
    "s3": ("nixl_backends.s3", "S3StoreConfig", "S3Store"),
    "s3agg": ("nixl_backends.s3agg", "S3AggStoreConfig", "S3AggStore"),
    "tiered": ("nixl_backends.tiered", "TieredStoreConfig", "TieredStore"),
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def _resolve(name: str) -> tuple[type, type[KVStore]]:
    module_name, config_name, store_name = _BACKENDS[name]
    module = importlib.import_module(module_name)
    return getattr(module, config_name), getattr(module, store_name)


def parse_store_config(data: dict[str, Any], where: str = "store.") -> Any:
    """Validate a store section ``{"backend": NAME, ...}`` into that backend's config dataclass."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.')!r} must be an object, got {type(data).__name__}")
    rest = dict(data)
    name = rest.pop("backend", None)
    if name not in _BACKENDS:
        raise ConfigError(f"bad value for {where}'backend': {name!r}; choose one of {backend_names()}")
    return from_dict(_resolve(name)[0], rest, where)


def for_rank(config: Any, tp_rank: int, pp_rank: int) -> Any:
    """The store config one engine rank opens: per-rank parts (a local tier's ``{tp_rank}`` root) filled in."""
    specialise = getattr(config, "for_rank", None)
    return specialise(tp_rank, pp_rank) if specialise is not None else config


def shared_tier(config: Any) -> Any:
    """What another machine (a router) can look chunks up in: a tiered store's last, shared tier.

    Saves write through, so it holds every stored chunk; the local tiers live on one engine's node.
    """
    return config.tier_configs[-1] if hasattr(config, "tier_configs") else config


def make_store(config: Any, layout: BlockLayout, agent=None) -> KVStore:
    """Open the store for a parsed config. Without ``agent`` only ``lookup`` works."""
    for name in _BACKENDS:
        config_cls, store_cls = _resolve(name)
        if isinstance(config, config_cls):
            return store_cls(config, layout, agent)
    raise TypeError(f"not a store config: {type(config).__name__}")
