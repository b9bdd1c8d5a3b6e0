"""NIXL's OBJ plugin on an agent: making it loadable, opening it for an ``s3`` section, device ids.

An OBJ registration names an object by a device id, and ids are per agent:
two stores (or a store and the gateway's ranged reads) on one agent sharing
ids would read and write each other's objects. So every OBJ user takes its ids
from :func:`obj_device_ids`, the one allocator per agent.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading
import weakref

import boto3

from nixl_backends.configuration import ConfigError
from nixl_backends.s3_endpoint import S3StoreConfig

logger = logging.getLogger(__name__)

OBJ = "OBJ"

_cuobj_lock = threading.Lock()
_cuobj_ready = False

_dev_ids_lock = threading.Lock()
# agent -> its next unused device id; the entry goes with the agent.
_next_dev_id: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


def ensure_obj_plugin_loadable() -> None:
    """Make NIXL's OBJ plugin loadable where NVIDIA's cuObject client is not installed.

    The plugin links libcuobjclient.so.1 for an optional RDMA path. When the
    real library is absent we load our stand-in (same SONAME, always "not
    connected") into the global scope, so the plugin uses plain S3.
    """
    global _cuobj_ready
    with _cuobj_lock:
        if _cuobj_ready:
            return
        try:
            ctypes.CDLL("libcuobjclient.so.1", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            found = glob.glob(os.path.join(os.path.dirname(__file__), "_cuobj_compat*.so"))
            if not found:
                raise RuntimeError(
                    "NIXL's OBJ plugin needs libcuobjclient.so.1 and the bundled stand-in "
                    "was not built; reinstall dualpath-kv with a C++ compiler available"
                ) from None
            ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
            logger.debug("loaded cuObject stand-in %s for NIXL OBJ", found[0])
        _cuobj_ready = True


def add_obj_backend(agent, config: S3StoreConfig, session: boto3.session.Session) -> None:
    """Open NIXL's OBJ backend on ``agent`` for ``config``'s bucket.

    With keys in ``config`` the plugin gets them (static keys never change).
    Without, it gets none and its AWS SDK resolves the standard credential
    chain itself (environment, shared config/profile, web identity token,
    container credentials endpoint, instance metadata), as ``session`` does
    for the boto3 side, and renews temporary credentials before they expire.
    Handing it the chain's credentials of the moment would freeze them: every
    request would fail once their session token expired, until a restart.
    """
    ensure_obj_plugin_loadable()
    credentials = session.get_credentials()
    if credentials is None:
        raise ConfigError("store: no S3 credentials in the config or the AWS credential chain")
    params = {
        "bucket": config.bucket,
        "region": config.region,
        "use_virtual_addressing": "true" if config.addressing_style == "virtual" else "false",
        "num_threads": str(config.io_threads),
        # The plugin's names for the SDK's WHEN_REQUIRED / WHEN_SUPPORTED.
        "req_checksum": config.request_checksum.removeprefix("when_"),
        "resp_checksum": config.response_checksum_validation.removeprefix("when_"),
    }
    if config.access_key is not None:
        params.update(access_key=config.access_key, secret_key=config.secret_key)
    else:
        logger.info("S3 credentials for NIXL OBJ: the AWS credential chain (%s), renewed by the AWS SDK",
                    credentials.method)
    if config.endpoint:
        params["endpoint_override"] = config.endpoint
        params["scheme"] = config.endpoint.split("://", 1)[0]
    if config.ca_bundle:
        params["ca_bundle"] = config.ca_bundle
    agent.create_backend(OBJ, params)


def obj_device_ids(agent, count: int) -> range:
    """``count`` OBJ device ids that no other caller on ``agent`` ever gets (ids start at 1)."""
    with _dev_ids_lock:
        start = _next_dev_id.get(agent, 1)
        _next_dev_id[agent] = start + count
    return range(start, start + count)
