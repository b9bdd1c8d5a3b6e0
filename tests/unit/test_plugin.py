"""The vLLM general plugin: ``DualPathConnector`` registered by name, found by vLLM's plugin loader, and
resolvable by name inside ``MultiConnector`` (no engine is started).

Every test runs against a private copy of ``KVConnectorFactory._registry`` *without* our name (the
``registry`` fixture, undone by monkeypatch), so each starts from the state before the plugin ran and
nothing leaks into other tests in the same process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging

import msgspec
import pytest
import vllm.envs as envs
import vllm.plugins
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorStats

from dualpath_connector import plugin
from dualpath_connector.config import parse_config
from dualpath_connector.connector import DualPathConnector
from dualpath_connector.metrics.stats import DualPathStats
from dualpath_connector.metrics.stats_recorder import StatsRecorder

NAME = "DualPathConnector"
ENTRY_POINT = "dualpath_connector.plugin:register"
NOT_REGISTERED = rf"Connector '{NAME}' is not registered"


@pytest.fixture
def registry(monkeypatch) -> dict:
    """The factory's registry as it is before our plugin runs; the real one comes back after the test."""
    private = {name: loader for name, loader in KVConnectorFactory._registry.items() if name != NAME}
    monkeypatch.setattr(KVConnectorFactory, "_registry", private)
    return private


def multi_ktc(tmp_path) -> KVTransferConfig:
    """MultiConnector holding DualPathConnector by name (posix store) next to vLLM's ExampleConnector."""
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": NAME,
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"store": {"backend": "posix", "root": str(tmp_path / "kv")}},
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")},
                },
            ]
        },
    )


def stats_payload() -> tuple[DualPathStats, dict]:
    """Our worker's stats and the payload the scheduler ships for a MultiConnector engine.

    The scheduler sends ``MultiKVConnectorStats.to_dict()`` (child class name -> ``stats.data``) to the
    front end through msgpack; MultiConnector rebuilds each child's stats class there, by name.
    """
    recorder = StatsRecorder()
    recorder.add(loaded_tokens=64, bytes_read=4096, saved_chunks=2)
    recorder.sample("load_seconds", 0.25)
    recorder.gauge(read_queue_tokens=3)
    data = recorder.take()
    assert data is not None
    stats = DualPathStats(data=data)
    payload = MultiKVConnectorStats(data={DualPathConnector.__name__: stats}).to_dict()
    return stats, msgspec.msgpack.decode(msgspec.msgpack.encode(payload))


# -- (a) register() ------------------------------------------------------------------------------------


def test_register_makes_the_connector_resolvable_by_name(registry):
    with pytest.raises(ValueError, match=NOT_REGISTERED):
        KVConnectorFactory.get_connector_class_by_name(NAME)

    plugin.register()

    assert KVConnectorFactory.get_connector_class_by_name(NAME) is DualPathConnector
    # By name alone, without kv_connector_module_path.
    assert KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=NAME, kv_role="kv_both")) is (
        DualPathConnector
    )
    # MultiConnector keys its children's stats by class name and looks that name up in the registry.
    assert DualPathConnector.__name__ == plugin.CONNECTOR_NAME == NAME


def test_register_twice_is_a_no_op(registry):
    plugin.register()
    loader = registry[NAME]
    plugin.register()  # vLLM's factory itself would raise "already registered"
    assert registry[NAME] is loader
    assert KVConnectorFactory.get_connector_class_by_name(NAME) is DualPathConnector


# -- (b) the entry point -------------------------------------------------------------------------------


def test_entry_point_is_declared():
    ours = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.value == ENTRY_POINT]
    assert len(ours) == 1, f"expected one vllm.general_plugins entry {ENTRY_POINT!r}, found {ours}"
    (ep,) = ours
    assert ep.name == "dualpath_kv"
    assert ep.dist is not None and ep.dist.name == "dualpath-kv"
    assert ep.load() is plugin.register


# -- (c) vLLM's plugin loader --------------------------------------------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch):
    """vLLM loads general plugins once per process; let it load again, without the LoRA resolvers' settings."""
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR", raising=False)
    monkeypatch.delenv("VLLM_LORA_RESOLVER_HF_REPO_LIST", raising=False)


@pytest.mark.parametrize("allowed", [None, "dualpath_kv"], ids=["all-plugins", "VLLM_PLUGINS=dualpath_kv"])
def test_vllm_plugin_loader_registers_the_connector(registry, fresh_loader, monkeypatch, allowed):
    if allowed is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    assert envs.VLLM_PLUGINS == (None if allowed is None else [allowed])
    assert NAME not in registry

    vllm.plugins.load_general_plugins()

    # The loader logs (does not raise) a plugin that fails to load: the registry is the proof.
    assert KVConnectorFactory.get_connector_class_by_name(NAME) is DualPathConnector


def test_vllm_plugin_loader_leaves_it_out_when_not_allowed(registry, fresh_loader, monkeypatch):
    """Control for the test above: what registered the connector there was the loader running our entry point."""
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    vllm.plugins.load_general_plugins()
    assert NAME not in registry


# -- (d) MultiConnector holding DualPathConnector by name ----------------------------------------------


def test_multiconnector_rebuilds_dualpath_stats_by_name(registry):
    plugin.register()
    stats, payload = stats_payload()
    assert set(payload) == {NAME}

    rebuilt = MultiConnector.build_kv_connector_stats(data=payload)

    assert isinstance(rebuilt, MultiKVConnectorStats)
    child = rebuilt[NAME]
    assert type(child) is DualPathStats
    assert child.data == stats.data
    reduced = rebuilt.reduce()[NAME]
    assert reduced["loaded_tokens"] == 64
    assert reduced["bytes_read"] == 4096
    assert reduced["load_seconds_median"] == 0.25
    assert reduced["read_queue_tokens"] == 3


def test_multiconnector_stats_reach_vllms_kv_transfer_log_line(registry, tmp_path):
    """The front end's stat logger path: KVConnectorLogging resolves MultiConnector, observes, aggregates, logs."""
    plugin.register()
    logging_ = KVConnectorLogging(multi_ktc(tmp_path))
    assert logging_.connector_cls is MultiConnector
    logging_.observe(stats_payload()[1])
    logging_.observe(stats_payload()[1])

    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))

    # One entry per child connector: our reduced stats, aggregated over both observations.
    assert len(lines) == 1
    assert f"{NAME}={{" in lines[0]
    assert "'loaded_tokens': 128" in lines[0] and "'bytes_read': 8192" in lines[0]


def test_multiconnector_resolves_the_child_class_by_name(registry, tmp_path):
    plugin.register()
    ktc = multi_ktc(tmp_path)
    child_extra = ktc.kv_connector_extra_config["connectors"][0]["kv_connector_extra_config"]
    parse_config(child_extra, "kv_both")  # the child's settings are a valid DualPathConnector configuration

    # VllmConfig's own checks already resolve the children (HMA support) by name.
    vllm_config = VllmConfig(kv_transfer_config=ktc)

    pairs = MultiConnector._get_connector_classes_and_configs(vllm_config)
    assert [cls for cls, _ in pairs] == [DualPathConnector, ExampleConnector]
    child_ktc = pairs[0][1].kv_transfer_config
    assert child_ktc.kv_connector == NAME
    assert child_ktc.kv_connector_extra_config == child_extra
    assert child_ktc.engine_id == ktc.engine_id

    assert KVConnectorFactory.get_connector_class(ktc) is MultiConnector
    assert MultiConnector.get_required_kvcache_layout(vllm_config) == DualPathConnector.get_required_kvcache_layout(
        pairs[0][1]
    )
    assert MultiConnector.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config) is bool(
        DualPathConnector.requires_piecewise_for_cudagraph(child_extra)
    )
    assert KVConnectorFactory.supports_hma_config(ktc) is (
        supports_hma(DualPathConnector) and supports_hma(ExampleConnector)
    )


def test_without_registration_multiconnector_fails_as_before_the_plugin(registry, tmp_path):
    """Negative control: the `registry` fixture removed our name, so the same calls must fail."""
    assert NAME not in registry
    _, payload = stats_payload()
    with pytest.raises(ValueError, match=NOT_REGISTERED):
        MultiConnector.build_kv_connector_stats(data=payload)

    ktc = multi_ktc(tmp_path)
    with pytest.raises(ValueError, match=rf"Unsupported connector type: {NAME}"):
        MultiConnector.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config)
    with pytest.raises(ValueError, match=rf"Unsupported connector type: {NAME}"):
        VllmConfig(kv_transfer_config=ktc)

    # A VllmConfig built while registered stops resolving once the name is gone.
    plugin.register()
    vllm_config = VllmConfig(kv_transfer_config=ktc)
    del registry[NAME]
    with pytest.raises(ValueError, match=rf"Unsupported connector type: {NAME}"):
        MultiConnector._get_connector_classes_and_configs(vllm_config)
    with pytest.raises(ValueError, match=rf"Unsupported connector type: {NAME}"):
        MultiConnector.get_required_kvcache_layout(vllm_config)


# -- logging in engine processes --------------------------------------------------------------------


def bare_logging(monkeypatch) -> None:
    """Logging as an engine process has it: no root handler, our package loggers untouched (restored after).

    Called in the test body: pytest adds its capturing handler to the root logger as each phase starts.
    """
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    for name in plugin.ENGINE_PACKAGES:
        package_logger = logging.getLogger(name)
        monkeypatch.setattr(package_logger, "handlers", [])
        monkeypatch.setattr(package_logger, "level", logging.NOTSET)


def _log_one_of_each() -> None:
    logging.getLogger("dualpath_connector.worker.worker").warning("chunk unreadable; hit shortened")
    logging.getLogger("nixl_backends.s3").info("requests failed; sending them again")


def test_engine_side_records_print_in_vllms_format_at_vllms_level(monkeypatch, capsys):
    bare_logging(monkeypatch)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    plugin.configure_logging()
    _log_one_of_each()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("WARNING ") and lines[0].endswith("] chunk unreadable; hit shortened")
    assert lines[1].startswith("INFO ") and "[test_plugin.py:" in lines[1]
    plugin.configure_logging()  # a second plugin load adds no second handler
    _log_one_of_each()
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.parametrize("setup", ["VLLM_CONFIGURE_LOGGING=0", "a root handler"])
def test_logging_the_user_configured_is_left_alone(monkeypatch, setup):
    """The control: the same calls add no handler where the user configured logging."""
    bare_logging(monkeypatch)
    if setup == "a root handler":
        monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])
    else:
        monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    plugin.configure_logging()
    assert all(not logging.getLogger(name).handlers for name in plugin.ENGINE_PACKAGES)


@pytest.mark.parametrize("name, module", [
    ("DualPathConnector", "dualpath_connector.connector"),
    ("EngineKeyGuard", "dualpath_connector.pd.engine_guard"),
    ("QuotaScheduler", "dualpath_connector.scheduler.compute_quota"),
    ("AsyncQuotaScheduler", "dualpath_connector.scheduler.compute_quota"),
])  # fmt: skip
def test_the_names_users_type_resolve_as_vllm_resolves_them(name, module):
    """``--scheduler-cls`` and ``--middleware`` take ``dualpath_connector.<name>``: vLLM imports the package and
    reads the attribute, which the package resolves from the module that defines it."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    assert resolve_obj_by_qualname(f"dualpath_connector.{name}") is getattr(importlib.import_module(module), name)


def test_a_misspelt_name_is_refused_as_a_missing_attribute():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    with pytest.raises(AttributeError, match="no attribute 'QuotaSchedular'"):
        resolve_obj_by_qualname("dualpath_connector.QuotaSchedular")
