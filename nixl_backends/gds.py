"""GPUDirect Storage through NIXL's GDS and GDS_MT plugins: file bytes straight into GPU memory.

Both plugins call cuFile (``libcufile.so.0``, from the CUDA toolkit or the
``nvidia-cufile`` wheel). Where the ``nvidia-fs`` kernel module is loaded,
cuFile DMAs from NVMe into GPU memory; without it cuFile runs in
*compatibility mode* (it reads through a host bounce buffer of its own), which
is correct but no faster than a host read. Where cuFile or a CUDA device is
missing the plugin does not start, and a store asking for it is refused at
start-up with the reason (:class:`GdsUnavailable`).
"""

from __future__ import annotations

import ctypes
import glob
import json
import logging
import os
import site
import sys
import tempfile
from typing import Any

from nixl_backends.configuration import ConfigError

logger = logging.getLogger(__name__)

GDS_PLUGINS = ("GDS", "GDS_MT")
CUFILE_LIBRARY = "libcufile.so.0"
# cuFile reads its settings from this file; we write one allowing compatibility mode where none is set.
CUFILE_CONFIG_ENV = "CUFILE_ENV_PATH_JSON"
# cuFile logs to ./cufile.log unless told otherwise, also before it has read a config.
CUFILE_LOG_ENV = "CUFILE_LOGFILE_PATH"


class GdsUnavailable(ConfigError):
    """A GDS plugin cannot run here; the message says which part is missing."""


def nvidia_fs_loaded() -> bool:
    """Whether true GPUDirect (DMA from storage into GPU memory) is possible: the nvidia-fs module is loaded."""
    return os.path.exists("/proc/driver/nvidia-fs")


def _cufile_candidates() -> list[str]:
    roots = [*sys.path, *site.getsitepackages()]
    found = []
    for root in dict.fromkeys(roots):
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", CUFILE_LIBRARY)))
    return [CUFILE_LIBRARY, *found, f"/usr/local/cuda/lib64/{CUFILE_LIBRARY}"]


def load_cufile() -> str:
    """Load cuFile into the process (global symbols), so the plugin's own ``dlopen`` finds it; its path.

    The plugin links ``libcufile.so.0`` by name: a wheel's copy outside the
    loader's path is found only when it is already loaded.
    """
    errors = []
    for candidate in _cufile_candidates():
        try:
            ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
            return candidate
        except OSError as exc:
            errors.append(str(exc))
    raise GdsUnavailable(f"{CUFILE_LIBRARY} not found (install nvidia-cufile or the CUDA toolkit); tried: {errors[0]}")


def allow_compat_mode() -> str | None:
    """Without nvidia-fs and without an operator's cuFile config, point cuFile at one that allows compatibility mode.

    Returns the config path written, or None where the operator's (or nvidia-fs) applies.
    """
    if nvidia_fs_loaded() or os.environ.get(CUFILE_CONFIG_ENV):
        return None
    config = {"properties": {"allow_compat_mode": True}, "logging": {"dir": tempfile.gettempdir(), "level": "ERROR"}}
    fd, path = tempfile.mkstemp(prefix="dualpath-cufile-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(config, out)
    os.environ[CUFILE_CONFIG_ENV] = path
    return path


def create_gds_backend(agent: Any, plugin: str, where: str = "store.gds") -> None:
    """Start NIXL's ``plugin`` (GDS or GDS_MT) on ``agent``, once; :class:`GdsUnavailable` naming why it cannot."""
    if plugin not in GDS_PLUGINS:
        raise GdsUnavailable(f"bad value for {where!r}: {plugin!r}; choose one of {list(GDS_PLUGINS)} or 'off'")
    if plugin in agent.backends:
        return
    if plugin not in agent.get_plugin_list():
        raise GdsUnavailable(f"{where}={plugin!r}: this NIXL build has no {plugin} plugin")
    os.environ.setdefault(CUFILE_LOG_ENV, os.path.join(tempfile.gettempdir(), f"cufile-{os.getpid()}.log"))
    try:
        load_cufile()
    except GdsUnavailable as exc:
        raise GdsUnavailable(f"{where}={plugin!r}: {exc}") from None
    allow_compat_mode()
    try:
        agent.create_backend(plugin, {})
    except Exception as exc:
        raise GdsUnavailable(
            f"{where}={plugin!r}: NIXL's {plugin} plugin did not start ({type(exc).__name__}: {exc}); it needs cuFile "
            "and a CUDA device; set it to 'off' to read through host memory"
        ) from None
    logger.info("%s: NIXL %s started (%s)", where, plugin,
                "GPUDirect through nvidia-fs" if nvidia_fs_loaded() else "cuFile compatibility mode: no nvidia-fs")
