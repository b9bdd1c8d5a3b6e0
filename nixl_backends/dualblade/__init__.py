"""Dual-Blade: a local NVMe KV tier with a budgeted page-cache path and a direct path (README.md beside this file)."""

from nixl_backends.dualblade.config import DualBladeStoreConfig
from nixl_backends.dualblade.store import DualBladeStore

__all__ = ["DualBladeStore", "DualBladeStoreConfig"]
