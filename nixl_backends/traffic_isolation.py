"""Traffic isolation for engine-to-engine KV transfers: which UCX service level, traffic class, devices, transports.

The paper (section 5, appendix A.1) keeps KV traffic in its own InfiniBand service level (RoCE:
its own DSCP / priority) so that the fabric's VL arbitration, not luck, decides how much of a
link KV pulls may take from the model's collectives. The connector's ``transport`` section sets
that for its UCX backend; docs/traffic-isolation.md covers the switch and subnet-manager side.

UCX reads these settings from ``UCX_*`` environment variables when NIXL creates the UCX backend
(``ucp_config_read``); NIXL's own UCX defaults only apply where the variable is unset. So the
settings become environment variables of the engine's worker process, set just before the
backend is created. A variable the operator already exported with another value is refused
at start-up (neither silently wins); the same value is accepted.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nixl_backends.configuration import ConfigError, from_dict
from nixl_backends.rdma_devices import RDMA_SYSFS, rdma_ports_present

# Key in the connector's config -> the UCX variable it sets.
UCX_VARIABLES = {
    # InfiniBand service level; on RoCEv2 the Ethernet priority (PCP) of the KV traffic.
    "ucx_ib_sl": "UCX_IB_SL",
    # The GRH traffic class byte; on RoCEv2 DSCP << 2 plus the ECN bits (UCX's own RoCE default is 106: DSCP 26, ECT).
    "ucx_ib_traffic_class": "UCX_IB_TRAFFIC_CLASS",
    # e.g. "mlx5_0:1,mlx5_1:1": the HCA ports KV transfers may use (UCX's default: all).
    "ucx_net_devices": "UCX_NET_DEVICES",
    # e.g. "rc,cuda_copy": UCX's transports (UCX's default: all that work).
    "ucx_tls": "UCX_TLS",
}
_RANGES = {"ucx_ib_sl": (0, 15), "ucx_ib_traffic_class": (0, 255)}


def interfaces_of(host: str) -> set[str] | None:
    """The network interfaces holding ``host``'s addresses; None for a wildcard address (every interface).

    Raises ConfigError when ``host`` is on no interface of this machine: nothing could bind there.
    """
    import psutil  # vLLM's dependency; the standard library cannot list interface addresses

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except socket.gaierror as exc:
        raise ConfigError(f"side_channel_host {host!r} does not resolve: {exc}") from None
    if any(ipaddress.ip_address(address.split("%")[0]).is_unspecified for address in addresses):
        return None
    interfaces = {name for name, entries in psutil.net_if_addrs().items()
                  for entry in entries if entry.address.split("%")[0] in addresses}  # fmt: skip
    if not interfaces:
        raise ConfigError(f"side_channel_host {host!r} ({', '.join(sorted(addresses))}) is on no network "
                          "interface of this machine")  # fmt: skip
    return interfaces



def source_address_toward(host: str, port: int) -> str | None:
    """The local address this machine sends from to reach ``host:port`` (the routing table's choice; connecting
    a UDP socket sends nothing); None when ``host`` does not resolve or no route leads there."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError:
        return None


@dataclass(frozen=True)
class UcxTraffic:
    """The connector's ``transport`` section; every key unset (the default) leaves UCX exactly as it was."""

    ucx_ib_sl: int | None = None
    ucx_ib_traffic_class: int | None = None
    ucx_net_devices: str | None = None
    ucx_tls: str | None = None

    def ucx_environment(self) -> dict[str, str]:
        """The ``UCX_*`` variables these settings set; empty by default."""
        return {UCX_VARIABLES[name]: str(value) for name in UCX_VARIABLES if (value := getattr(self, name)) is not None}

    def check_environment(self, where: str, environ: Mapping[str, str] = os.environ) -> None:
        """Refuse a setting whose UCX variable ``environ`` already sets to another value."""
        for name, variable in UCX_VARIABLES.items():
            value = getattr(self, name)
            if value is not None and environ.get(variable, str(value)) != str(value):
                raise ConfigError(
                    f"{where}{name} is {value!r} but the environment sets {variable}={environ[variable]!r}; "
                    f"UCX would silently take one of them: unset {variable} or make the two agree"
                )

    def listening_on(self, host: str, environ: Mapping[str, str] = os.environ,
                     rdma_root: Path = RDMA_SYSFS) -> UcxTraffic:
        """These settings, with UCX's network devices narrowed to ``host``'s interface unless chosen already.

        UCX's TCP transport listens on every network interface it may use, UCX's default being all of them: an
        engine whose side channel binds to 127.0.0.1 would still take KV reads on its public address. Narrowed
        to the interface that carries ``host`` (plus every RDMA port, whose transports do not listen on an IP
        address), UCX listens where the side channel does. ``transport.ucx_net_devices`` or an exported
        UCX_NET_DEVICES wins; a wildcard host (``0.0.0.0``, ``::``) leaves UCX's default.
        """
        if self.ucx_net_devices is not None or "UCX_NET_DEVICES" in environ:
            return self
        interfaces = interfaces_of(host)
        if interfaces is None:
            return self
        return replace(self, ucx_net_devices=",".join(sorted(interfaces) + rdma_ports_present(rdma_root)))

    def reaching(self, host: str, port: int, environ: Mapping[str, str] = os.environ,
                 rdma_root: Path = RDMA_SYSFS) -> UcxTraffic:  # fmt: skip
        """These settings, with UCX's network devices narrowed to the interface this machine reaches
        ``host:port`` through (:meth:`listening_on` its source address), unless chosen already; unchanged when
        no route is found. For a peer that connects to us (a gateway WRITing into our buffers): UCX's default
        lists every interface in our address, also one that is gone when the peer tries it."""
        source = source_address_toward(host, port)
        return self if source is None else self.listening_on(source, environ, rdma_root)

    def apply(self, where: str, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
        """Put the settings into ``environ``, before NIXL creates the UCX backend; returns the variables set."""
        self.check_environment(where, environ)
        variables = self.ucx_environment()
        environ.update(variables)
        return variables


def parse_traffic(section: Any, where: str, environ: Mapping[str, str] = os.environ) -> UcxTraffic:
    """The ``transport`` section (a dict; None: the default), checked against ``environ``; ``where`` prefixes key names.

    The connector's own parser has already refused a section that is not a dict.
    """
    traffic = from_dict(UcxTraffic, section, where)
    for name, (low, high) in _RANGES.items():
        value = getattr(traffic, name)
        if value is not None and not low <= value <= high:
            raise ConfigError(f"{where}{name} must be in {low}..{high}, got {value}")
    for name in ("ucx_net_devices", "ucx_tls"):
        value = getattr(traffic, name)
        if value is not None and (not value or any(c.isspace() or c in "=\0" for c in value)):
            raise ConfigError(f"bad value for {where}{name}: {value!r}; expected a comma-separated list without "
                              "spaces, e.g. 'mlx5_0:1,mlx5_1:1' or 'rc,cuda_copy'")  # fmt: skip
    traffic.check_environment(where, environ)
    return traffic
