"""RDMA device discovery through pyverbs (rdma-core's Python binding), when it is installed.

pyverbs is optional: it comes with rdma-core (``python3-pyverbs`` on Debian/Ubuntu), not from
PyPI, and only matters on hosts with InfiniBand/RoCE HCAs. ``dualpath-kv doctor`` uses it to
list the HCAs and to check that the devices named in the connector's ``transport.ucx_net_devices``
exist.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

RDMA_SYSFS = Path("/sys/class/infiniband")


class RdmaUnavailable(RuntimeError):
    """No RDMA device can be listed here; the message says why (pyverbs missing, or no device)."""


def _pyverbs_device() -> ModuleType:
    try:
        return importlib.import_module("pyverbs.device")
    except ImportError as exc:
        raise RdmaUnavailable(
            f"pyverbs is not installed ({exc}); it comes with rdma-core (apt install python3-pyverbs), "
            "and is needed only to list InfiniBand/RoCE devices"
        ) from None


def rdma_device_names() -> list[str]:
    """The RDMA devices' names (``mlx5_0``, ...) as libibverbs lists them; raises :class:`RdmaUnavailable`."""
    device = _pyverbs_device()
    try:
        devices = device.get_device_list()
    except Exception as exc:  # pyverbs raises its own PyverbsRDMAError when libibverbs cannot list
        raise RdmaUnavailable(f"pyverbs could not list RDMA devices: {type(exc).__name__}: {exc}") from None
    names = sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices)
    if not names:
        raise RdmaUnavailable("pyverbs sees no RDMA device (no InfiniBand/RoCE HCA, or its driver is not loaded)")
    return names


def rdma_ports(ucx_net_devices: str) -> list[str]:
    """The RDMA devices in a UCX_NET_DEVICES value: its ``device:port`` entries (others are network interfaces)."""
    return [entry.split(":", 1)[0] for entry in ucx_net_devices.split(",") if ":" in entry]


def rdma_ports_present(root: Path = RDMA_SYSFS) -> list[str]:
    """Every RDMA port as UCX names it (``mlx5_0:1``), from sysfs (no pyverbs needed); none without HCAs."""
    if not root.is_dir():
        return []
    return sorted(f"{device.name}:{port.name}" for device in root.iterdir() if (device / "ports").is_dir()
                  for port in (device / "ports").iterdir())  # fmt: skip
