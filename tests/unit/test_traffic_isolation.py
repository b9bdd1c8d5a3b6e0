"""The connector's ``transport`` section (UCX service level, traffic class, devices, transports) and
RDMA device discovery: every bad key named, defaults change nothing, a set value reaches UCX.

UCX here runs on loopback (TCP/CMA, no HCA), so the service level cannot be seen on a wire; that a
setting reaches the UCX the backend creates is shown with UCX_TLS, which this machine can refuse.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
import types

import pytest

from dualpath_connector.config import parse_config
from nixl_backends.configuration import ConfigError
from nixl_backends.doctor import FAIL, OK, SKIP, WARN, Target, check_rdma
from nixl_backends.rdma_devices import RdmaUnavailable, rdma_device_names, rdma_ports
from nixl_backends.traffic_isolation import UCX_VARIABLES, UcxTraffic, parse_traffic, source_address_toward
from nixl_backends.transport import add_ucx_backend
from tests.conftest import REPO_ROOT

WHERE = "kv_connector_extra_config.transport."


@pytest.fixture(autouse=True)
def no_ucx_variables(monkeypatch):
    """Each test starts without the UCX variables, and leaves them as they were (absent ones removed again)."""
    for variable in UCX_VARIABLES.values():
        # setenv records the original value (or its absence) for the undo; delenv of an absent one would not.
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)


@pytest.fixture(autouse=True)
def integrity_secret(monkeypatch):
    """configs/pe.json runs integrity: keyed, which needs the deployment's secret to parse."""
    monkeypatch.setenv("DUALPATH_INTEGRITY_KEY", "isolation-test-integrity-secret")


def pe_extra(**transport) -> dict:
    extra = json.loads((REPO_ROOT / "configs" / "pe.json").read_text())["kv_connector_extra_config"]
    return {**extra, "transport": transport} if transport else extra


# -- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"ucx_ib_sl": 16}, f"{WHERE}ucx_ib_sl must be in 0..15, got 16"),
        ({"ucx_ib_sl": -1}, f"{WHERE}ucx_ib_sl must be in 0..15, got -1"),
        ({"ucx_ib_sl": "3"}, f"bad value for {WHERE}'ucx_ib_sl': '3'"),
        ({"ucx_ib_sl": True}, f"bad value for {WHERE}'ucx_ib_sl': True"),
        ({"ucx_ib_traffic_class": 256}, f"{WHERE}ucx_ib_traffic_class must be in 0..255, got 256"),
        ({"ucx_ib_traffic_class": 10.5}, f"bad value for {WHERE}'ucx_ib_traffic_class': 10.5"),
        ({"ucx_net_devices": ""}, f"bad value for {WHERE}ucx_net_devices: ''"),
        ({"ucx_net_devices": "mlx5_0:1, mlx5_1:1"}, f"bad value for {WHERE}ucx_net_devices: 'mlx5_0:1, mlx5_1:1'"),
        ({"ucx_tls": ["rc"]}, f"bad value for {WHERE}'ucx_tls': ['rc']"),
        ({"ucx_tls": "rc\ncuda_copy"}, f"bad value for {WHERE}ucx_tls: 'rc\\ncuda_copy'"),
        ({"ucx_ib_service_level": 3}, f"unknown key {WHERE}'ucx_ib_service_level'"),
    ],
)
def test_each_bad_key_is_named_at_start_up(section, message):
    with pytest.raises(ConfigError) as raised:
        parse_config(pe_extra(**section), "kv_producer")
    assert message in str(raised.value)


def test_a_transport_section_that_is_not_an_object_is_refused():
    with pytest.raises(ConfigError, match=r"^bad value for kv_connector_extra_config.'transport': \[3\] is not dict"):
        parse_config({**pe_extra(), "transport": [3]}, "kv_producer")


def test_transport_is_refused_where_no_engine_to_engine_transfer_uses_it():
    with pytest.raises(ConfigError, match="transport applies to KV transfers between engines"):
        parse_config(pe_extra(ucx_ib_sl=3), "kv_both")


# -- what reaches UCX ---------------------------------------------------------------------------------------


def test_the_default_sets_nothing():
    assert parse_config(pe_extra(), "kv_producer").transport_config == UcxTraffic()
    environ = {"PATH": "/bin", "UCX_LOG_LEVEL": "warn"}
    assert UcxTraffic().apply(WHERE, environ) == {}
    assert environ == {"PATH": "/bin", "UCX_LOG_LEVEL": "warn"}


def test_the_default_backend_is_created_with_the_environment_unchanged(nixl_agent):
    before = dict(os.environ)
    add_ucx_backend(nixl_agent, parse_config(pe_extra(), "kv_producer").transport_config)
    assert "UCX" in nixl_agent.backends
    assert dict(os.environ) == before


def test_each_setting_becomes_its_ucx_variable():
    traffic = parse_traffic(
        {"ucx_ib_sl": 3, "ucx_ib_traffic_class": 106, "ucx_net_devices": "mlx5_0:1,mlx5_1:1", "ucx_tls": "rc,cuda_copy"},
        WHERE, environ={},
    )  # fmt: skip
    environ = {"PATH": "/bin"}
    assert traffic.apply(WHERE, environ) == {
        "UCX_IB_SL": "3", "UCX_IB_TRAFFIC_CLASS": "106", "UCX_NET_DEVICES": "mlx5_0:1,mlx5_1:1", "UCX_TLS": "rc,cuda_copy",
    }  # fmt: skip
    assert environ["PATH"] == "/bin" and environ["UCX_IB_SL"] == "3"


def test_a_setting_reaches_the_ucx_the_backend_creates(nixl_agent, caplog):
    # UCX_TLS=sm,self leaves UCX no transport with peer failure handling: the backend must fail.
    with caplog.at_level("INFO", logger="nixl_backends.transport"):
        with pytest.raises(Exception, match="NIXL_ERR_BACKEND"):
            add_ucx_backend(nixl_agent, UcxTraffic(ucx_tls="sm,self"), WHERE)
    assert os.environ["UCX_TLS"] == "sm,self"
    assert "UCX backend for KV transfers with UCX_TLS=sm,self" in caplog.text


def test_a_service_level_is_exported_and_the_backend_still_created(nixl_agent):
    # Negative control for the test above: the same agent setup without UCX_TLS works.
    add_ucx_backend(nixl_agent, UcxTraffic(ucx_ib_sl=3, ucx_ib_traffic_class=106), WHERE)
    assert "UCX" in nixl_agent.backends
    assert (os.environ["UCX_IB_SL"], os.environ["UCX_IB_TRAFFIC_CLASS"]) == ("3", "106")


# -- the environment already sets a UCX variable ----------------------------------------------------------------


def test_a_conflicting_environment_variable_is_refused_naming_both(monkeypatch):
    monkeypatch.setenv("UCX_IB_SL", "1")
    with pytest.raises(ConfigError) as raised:
        parse_config(pe_extra(ucx_ib_sl=3), "kv_producer")
    assert str(raised.value).startswith(f"{WHERE}ucx_ib_sl is 3 but the environment sets UCX_IB_SL='1'")


def test_the_same_value_in_the_environment_is_accepted(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "rc,cuda_copy")
    config = parse_config(pe_extra(ucx_tls="rc,cuda_copy"), "kv_producer")
    environ = {"UCX_TLS": "rc,cuda_copy"}
    assert config.transport_config.apply(WHERE, environ) == {"UCX_TLS": "rc,cuda_copy"}


def test_a_variable_the_config_does_not_set_is_left_to_the_environment(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_2:1")
    environ = dict(os.environ)
    parse_config(pe_extra(ucx_ib_sl=3), "kv_producer").transport_config.apply(WHERE, environ)
    assert environ["UCX_NET_DEVICES"] == "mlx5_2:1" and environ["UCX_IB_SL"] == "3"


def test_a_conflict_appearing_after_start_up_is_still_refused_before_ucx_reads_it():
    traffic = parse_traffic({"ucx_ib_sl": 3}, WHERE, environ={})
    environ = {"UCX_IB_SL": "5"}
    with pytest.raises(ConfigError, match="ucx_ib_sl is 3 but the environment sets UCX_IB_SL='5'"):
        traffic.apply(WHERE, environ)
    assert environ == {"UCX_IB_SL": "5"}


# -- UCX listens where the side channel does ------------------------------------------------------------------


def test_a_loopback_side_channel_narrows_ucx_to_the_loopback_interface(tmp_path):
    no_hca = tmp_path / "infiniband"
    assert UcxTraffic().listening_on("127.0.0.1", {}, no_hca).ucx_net_devices == "lo"
    # RDMA ports stay usable: their transports do not listen on an IP address.
    for device in ("mlx5_1", "mlx5_0"):
        (no_hca / device / "ports" / "1").mkdir(parents=True)
    traffic = UcxTraffic(ucx_ib_sl=3).listening_on("127.0.0.1", {}, no_hca)
    assert (traffic.ucx_net_devices, traffic.ucx_ib_sl) == ("lo,mlx5_0:1,mlx5_1:1", 3)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_side_channel_leaves_ucx_its_default(host):
    assert UcxTraffic().listening_on(host, {}) == UcxTraffic()


def test_devices_the_operator_chose_win_over_the_side_channels():
    chosen = UcxTraffic(ucx_net_devices="mlx5_0:1")
    assert chosen.listening_on("127.0.0.1", {}) is chosen
    assert UcxTraffic().listening_on("127.0.0.1", {"UCX_NET_DEVICES": "eth1"}) == UcxTraffic()


def test_a_side_channel_host_on_no_interface_is_refused_naming_it():
    # 203.0.113.0/24 is documentation space: no interface of a test machine holds it.
    with pytest.raises(ConfigError, match=r"^side_channel_host '203.0.113.7' \(203.0.113.7\) is on no network"):
        UcxTraffic().listening_on("203.0.113.7", {})


def test_a_gateway_reached_over_loopback_narrows_ucx_to_the_loopback_interface(tmp_path):
    """The s3agg client's UCX (the gateway WRITEs into it) listens where the route to the gateway leaves."""
    no_hca = tmp_path / "infiniband"
    assert source_address_toward("127.0.0.1", 9000) == "127.0.0.1"
    assert UcxTraffic().reaching("127.0.0.1", 9000, {}, no_hca).ucx_net_devices == "lo"
    assert UcxTraffic().reaching("localhost", 9000, {"UCX_NET_DEVICES": "eth1"}, no_hca) == UcxTraffic()
    # No route (a name that does not resolve): UCX keeps its default rather than a guess.
    assert source_address_toward("no-such-host.invalid", 9000) is None
    assert UcxTraffic().reaching("no-such-host.invalid", 9000, {}, no_hca) == UcxTraffic()


def _listening(pid: int) -> set[tuple[str, int]]:
    import psutil

    return {c.laddr[:2] for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN}


def test_the_backend_listens_on_the_side_channels_interface_alone(nixl_agent):
    """Real UCX: its TCP listeners after a backend narrowed to 127.0.0.1 are on loopback addresses only."""
    before = _listening(os.getpid())
    add_ucx_backend(nixl_agent, UcxTraffic().listening_on("127.0.0.1"), WHERE)
    opened = _listening(os.getpid()) - before
    assert opened and all(ipaddress.ip_address(address).is_loopback for address, _ in opened), opened


def test_control_ucxs_default_listens_beyond_loopback(nixl_agent):
    """Without the narrowing, UCX listens on every interface it may use: the test above can fail."""
    import psutil

    public = [e for entries in psutil.net_if_addrs().values() for e in entries
              if e.family == socket.AF_INET and not ipaddress.ip_address(e.address).is_loopback]  # fmt: skip
    if not public:
        pytest.skip("this machine has no non-loopback IPv4 address for UCX to listen on")
    before = _listening(os.getpid())
    add_ucx_backend(nixl_agent, UcxTraffic(), WHERE)
    opened = _listening(os.getpid()) - before
    assert any(not ipaddress.ip_address(address).is_loopback for address, _ in opened), opened


# -- RDMA devices (pyverbs) ---------------------------------------------------------------------------------------


def test_pyverbs_missing_says_so_and_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # as on this machine's venv: no rdma-core binding
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    with pytest.raises(RdmaUnavailable, match=r"^pyverbs is not installed .*apt install python3-pyverbs"):
        rdma_device_names()


def fake_pyverbs(monkeypatch, names: list[bytes]) -> None:
    # A stand-in for rdma-core's binding: this machine has no HCA (and no kernel InfiniBand support).
    device = types.ModuleType("pyverbs.device")
    device.get_device_list = lambda: [types.SimpleNamespace(name=name) for name in names]
    monkeypatch.setitem(sys.modules, "pyverbs", types.ModuleType("pyverbs"))
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)


def test_pyverbs_without_devices_says_so(monkeypatch):
    fake_pyverbs(monkeypatch, [])
    with pytest.raises(RdmaUnavailable, match="^pyverbs sees no RDMA device"):
        rdma_device_names()


def test_ucx_device_ports_are_the_rdma_entries():
    assert rdma_ports("mlx5_0:1,eth0,mlx5_1:1") == ["mlx5_0", "mlx5_1"]


def target(**transport) -> Target:
    return Target("kv_producer", "dualpath", None, parse_traffic(transport, WHERE, environ={}), WHERE)


def test_doctor_skips_when_no_rdma_is_seen_and_none_is_configured(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    result = check_rdma(target())
    assert (result.name, result.status) == ("rdma devices", SKIP)
    assert result.detail.startswith("pyverbs is not installed") and "names no RDMA device" in result.detail


def test_doctor_warns_when_configured_devices_cannot_be_checked(monkeypatch):
    fake_pyverbs(monkeypatch, [])
    result = check_rdma(target(ucx_net_devices="mlx5_0:1"))
    assert result.status == WARN and "cannot check mlx5_0" in result.detail


def test_doctor_fails_a_configured_device_that_does_not_exist(monkeypatch):
    fake_pyverbs(monkeypatch, [b"mlx5_0", b"mlx5_1"])
    result = check_rdma(target(ucx_net_devices="mlx5_0:1,mlx5_4:1"))
    assert result.status == FAIL and result.detail.startswith("mlx5_4 (transport.ucx_net_devices) not among")
    # Negative control: the same listing passes devices that exist.
    assert check_rdma(target(ucx_net_devices="mlx5_1:1")).status == OK
    assert check_rdma(target()).detail == "mlx5_0, mlx5_1"


def test_doctor_creates_its_ucx_backend_with_the_configured_settings(tmp_path):
    from dualpath_connector.doctor import diagnose

    def ucx_line(transport: dict) -> tuple[str, str]:
        extra = {"store": {"backend": "posix", "root": str(tmp_path)}, "side_channel_port": 5600, "transport": transport}
        document = {"kv_connector": "DualPathConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}
        result = next(r for r in diagnose(document) if r.name == "nixl UCX")
        return result.status, result.detail

    # UCX_TLS=sm,self: the engine's UCX backend would fail, and so does the doctor's.
    status, detail = ucx_line({"ucx_tls": "sm,self"})
    assert status == FAIL and "NIXL_ERR_BACKEND" in detail
    os.environ.pop("UCX_TLS")  # the doctor exported it; the autouse fixture restores the original afterwards
    assert ucx_line({"ucx_ib_sl": 3}) == (OK, "backend created")
