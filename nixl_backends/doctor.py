"""``dualpath-kv doctor``: what would stop an engine, checked before it is launched.

One line per check, in order: the configuration parses (for a connector configuration the
connector's own parser, so the verdict is the engine's: :mod:`dualpath_connector.doctor`, which
passes the parsed target and its own checks in, such as the PD side channel's key), the RDMA
devices pyverbs sees include those the ``transport`` section names, NIXL's UCX (with those
settings), POSIX and OBJ plugins load, every store the configuration names is reachable with the
credentials the engine would use, and writable: a probe object is written, read back and
compared, and deleted, all through the store's own code (NIXL for the bytes; a missing bucket
is created, as the engine would with ``create_bucket``). A check that
depends on a failed one is skipped. A plugin the configuration does not use only warns.

Secrets never reach the output: the configured secret keys, the AWS credential chain's secret
and session token, and the project's key variables are replaced by ``<redacted>`` in every line,
whatever produced the message (the stores' own errors already omit them; this is the second wall).

A Dual-Blade tier is not opened here: its extent file is carved by the engine's layout, which
only the engine knows, so the doctor checks that its root directory is writable instead.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from nixl_backends.configuration import ConfigError
from nixl_backends.layout import HASH_HEX_CHARS, BlockLayout, chunk_key
from nixl_backends.rdma_devices import RdmaUnavailable, rdma_device_names, rdma_ports
from nixl_backends.registry import for_rank, parse_store_config
from nixl_backends.s3_endpoint import UntrustedServer
from nixl_backends.traffic_isolation import UcxTraffic

OK, FAIL, WARN, SKIP = "ok", "fail", "warn", "skip"
PD_ROLES = ("kv_producer", "kv_consumer")
PLUGINS = ("UCX", "POSIX", "OBJ")
# Environment variables whose values never appear in the output.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "DUALPATH_CLUSTER_KEY", "DUALPATH_INTEGRITY_KEY",
              "VLLM_API_KEY", "DUALPATH_ENGINE_API_KEY", "S3AGG_CLIENT_SECRET_KEY")  # fmt: skip
REDACTED = "<redacted>"
# The probe: one small object, named like a chunk under a namespace no engine has (gc leaves it alone).
PROBE_LAYOUT = BlockLayout(num_layers=2, layer_block_bytes=4096)
PROBE_NAMESPACE = "doctor-probe"
CONFIG_DOCS = "see README.md, 'Configuration reference'"


@dataclass(frozen=True)
class CheckResult:
    """One line of the report: ``fix`` says what to do when ``status`` is fail or warn."""

    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Target:
    """What the checks after parsing need: the role, the key prefix and the parsed store section."""

    kv_role: str
    key_prefix: str
    store: Any
    # The connector's `transport` section; a bare store section has none.
    transport: UcxTraffic | None = None
    # Where the transport section's keys are named in errors.
    transport_where: str = ""


class Redactor:
    """Replaces every known secret value in a text; built from a config document and the environment."""

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self._secrets: set[str] = {environ[name] for name in SECRET_ENV if environ.get(name)}

    def add(self, value: Any) -> None:
        # Short values would blank out ordinary words; no real secret is that short.
        if isinstance(value, str) and len(value) >= 4:
            self._secrets.add(value)

    def add_from_document(self, document: Any) -> None:
        """Every value under a key that names a secret (secret_key, session_token, ...), at any depth."""
        if isinstance(document, dict):
            for key, value in document.items():
                if isinstance(key, str) and any(word in key.lower() for word in ("secret", "token", "password")):
                    self.add(value)
                self.add_from_document(value)
        elif isinstance(document, list):
            for item in document:
                self.add_from_document(item)

    def __call__(self, text: str) -> str:
        for secret in sorted(self._secrets, key=len, reverse=True):
            text = text.replace(secret, REDACTED)
        return text

    def result(self, result: CheckResult) -> CheckResult:
        return CheckResult(result.name, result.status, self(result.detail), self(result.fix))


# -- parsing ---------------------------------------------------------------------------------------------


def parse_store_target(section: Any, key_prefix: str) -> Target:
    """A bare ``store`` section (as ``dualpath-kv gc`` takes it)."""
    return Target("kv_both", key_prefix, parse_store_config(section))


# -- the stores a configuration names --------------------------------------------------------------------


def _stores(config: Any) -> list[Any]:
    """The store configs to check, for rank 0 of the engine: a tiered store's tiers, each on its own."""
    config = for_rank(config, 0, 0)
    return list(getattr(config, "tier_configs", None) or [config])


def _backend(config: Any) -> str:
    return type(config).__name__.removesuffix("StoreConfig").lower()


def describe(config: Any) -> str:
    """A store in a few words; no credential."""
    backend = _backend(config)
    if hasattr(config, "bucket"):
        return f"{backend} {config.endpoint or 'AWS'} bucket {config.bucket!r}"
    if hasattr(config, "gateway"):
        return f"{backend} gateway {config.gateway}, bucket {config.s3_config.bucket!r}"
    return f"{backend} {getattr(config, 'root', None) or getattr(config, 'device', '')}"


def _needs(target: Target | None) -> set[str]:
    if target is None:
        return set(PLUGINS)
    needed = {"UCX"} if target.kv_role in PD_ROLES else set()
    for config in _stores(target.store):
        needed.add("POSIX" if _backend(config) in ("posix", "dualblade") else "OBJ")
        if _backend(config) == "s3agg":
            needed.add("UCX")  # the gateway WRITEs layers into the reader's buffers
    return needed


def _is_dualblade(config: Any) -> bool:
    return _backend(config) == "dualblade"


# -- the checks ------------------------------------------------------------------------------------------


def check_rdma(target: Target | None) -> CheckResult:
    """The RDMA devices pyverbs sees, and those ``transport.ucx_net_devices`` names among them."""
    traffic = target.transport if target else None
    wanted = rdma_ports(traffic.ucx_net_devices) if traffic and traffic.ucx_net_devices else []
    label = "rdma devices"
    try:
        found = rdma_device_names()
    except RdmaUnavailable as exc:
        if not wanted:
            return CheckResult(label, SKIP, f"{exc}; this configuration names no RDMA device")
        return CheckResult(label, WARN, f"{exc}; cannot check {', '.join(wanted)} (transport.ucx_net_devices)",
                           "install pyverbs to check them here; the UCX backend check below still tries them")  # fmt: skip
    missing = [name for name in wanted if name not in found]
    if missing:
        return CheckResult(label, FAIL, f"{', '.join(missing)} (transport.ucx_net_devices) not among {', '.join(found)}",
                           "name existing devices (ibv_devinfo -l lists them) in transport.ucx_net_devices")  # fmt: skip
    return CheckResult(label, OK, f"{', '.join(found)}" + (f"; configured: {', '.join(wanted)}" if wanted else ""))


def _check_plugin(agent: Any, name: str, io_engine: str, target: Target | None = None) -> str:
    """Load plugin ``name`` on ``agent`` as the project does; raises with the reason."""
    if name not in agent.get_plugin_list():
        raise RuntimeError(f"NIXL found no {name} plugin (NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR', 'unset')})")
    if name == "UCX":
        from nixl_backends.transport import add_ucx_backend

        # With the configured UCX settings: the engine's worker creates its backend with them too.
        add_ucx_backend(agent, target.transport if target else None, target.transport_where if target else "")
        return "backend created"
    if name == "POSIX":
        from nixl_backends.posix import create_posix_backend

        create_posix_backend(agent, io_engine)
        return f"backend created ({io_engine})"
    # OBJ: the backend needs a bucket and credentials, so the store check creates it; here the plugin is loaded.
    from nixl_backends.obj_backend import ensure_obj_plugin_loadable

    ensure_obj_plugin_loadable()
    agent.get_plugin_params(name)
    return "plugin loaded"


def check_plugins(agent: Any, target: Target | None) -> Iterator[CheckResult]:
    needed = _needs(target)
    io_engine = next((c.io_engine for c in _stores(target.store) if hasattr(c, "io_engine")), "aio") if target else "aio"
    for name in PLUGINS:
        label = f"nixl {name}"
        try:
            yield CheckResult(label, OK, _check_plugin(agent, name, io_engine, target))
        except Exception as exc:  # NIXL raises its own types (nixlNotFoundError, ...), or a RuntimeError
            use = "this configuration uses it" if name in needed else "this configuration does not use it"
            yield CheckResult(label, FAIL if name in needed else WARN, f"{type(exc).__name__}: {exc} ({use})",
                              "install NIXL with its plugins (pip install nixl) or point NIXL_PLUGIN_DIR at them")  # fmt: skip


def _open_failure(config: Any, exc: BaseException) -> CheckResult:
    where = describe(config)
    if isinstance(exc, UntrustedServer):
        return CheckResult(f"store {where}", FAIL, str(exc),
                           "set store.ca_bundle to the PEM file of the CA that signed the endpoint's certificate")
    if isinstance(exc, ConfigError):
        fix = ("check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the AWS config files, an instance role), the "
               "endpoint and the bucket's policy") if hasattr(config, "bucket") or hasattr(config, "gateway") \
            else CONFIG_DOCS  # fmt: skip
        return CheckResult(f"store {where}", FAIL, str(exc), fix)
    if isinstance(exc, OSError):
        return CheckResult(f"store {where}", FAIL, f"{type(exc).__name__}: {exc}",
                           "create the directory (or mount the file system) with access for the engine's user")  # fmt: skip
    return CheckResult(f"store {where}", FAIL, f"{type(exc).__name__}: {exc}", "see the message")


def _s3_credentials(config: Any, redact: Redactor) -> CheckResult | None:
    """An S3 store with no credentials anywhere fails here, naming where they are looked for."""
    s3 = getattr(config, "s3_config", config)
    if not hasattr(s3, "bucket"):
        return None
    from nixl_backends.s3_endpoint import s3_session

    credentials = s3_session(s3).get_credentials()
    if credentials is None:
        return CheckResult(f"store {describe(config)}", FAIL, "no S3 credentials in the config or the AWS chain",
                           "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or use the AWS config files "
                           "or an instance role)")  # fmt: skip
    frozen = credentials.get_frozen_credentials()
    redact.add(frozen.secret_key)
    redact.add(frozen.token)
    return None


def _check_gateway(config: Any) -> CheckResult:
    """An s3agg store's gateway answers ``/healthz``; without it reads still work, as plain S3 GETs."""
    import ssl
    import urllib.error
    import urllib.request

    label = f"gateway {config.gateway}"
    # An https gateway is checked as the store's reads check it: against gateway_ca_bundle (or the system's CAs).
    tls = ssl.create_default_context(cafile=config.gateway_ca_bundle) if config.gateway.startswith("https") else None
    try:
        with urllib.request.urlopen(f"{config.gateway.rstrip('/')}/healthz", timeout=config.connect_timeout_s,
                                    context=tls) as answer:
            status = answer.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:  # refused, unreachable, timed out
        return CheckResult(label, WARN, f"not reachable ({exc}); reads fall back to plain S3 GETs, without "
                           "layerwise aggregation", "start s3agg-gateway there or fix store.gateway")  # fmt: skip
    if status != 200:
        return CheckResult(label, WARN, f"/healthz answered {status}; reads may fall back to plain S3 GETs",
                           "see the gateway's log")  # fmt: skip
    return CheckResult(label, OK, "/healthz answered 200")


def _probe_directory(config: Any) -> CheckResult:
    """A Dual-Blade root: create it, write, read back and remove a probe file (the engine opens the tier)."""
    label = f"store {describe(config)}"
    root = config.root
    path = os.path.join(root, f".doctor-probe-{uuid.uuid4().hex}")
    data = os.urandom(PROBE_LAYOUT.object_bytes)
    try:
        os.makedirs(root, exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)
        with open(path, "rb") as file:
            back = file.read()
        os.unlink(path)
    except OSError as exc:
        return CheckResult(label, FAIL, f"cannot write under the root: {type(exc).__name__}: {exc}",
                           f"make {root} writable for the engine's user (uid {os.geteuid()})")  # fmt: skip
    if back != data:
        return CheckResult(label, FAIL, "a probe file read back different bytes", "check the device and file system")
    return CheckResult(label, OK, f"root writable ({len(data)}-byte probe file written, read back, removed); "
                       "the tier itself is opened by the engine")  # fmt: skip


class ProbeFailed(RuntimeError):
    """The probe's write, read-back or delete did not do what it should; the message says which."""


def _probe_store(store: Any, key_prefix: str, pool: Any) -> str:
    """Write, read back and delete one probe object through ``store``; returns what was done, raises why not."""
    key = chunk_key(key_prefix, PROBE_NAMESPACE, uuid.uuid4().hex.ljust(HASH_HEX_CHARS, "0"))
    slots = pool.acquire(2)
    try:
        out, back = (pool.array[s * pool.slot_stride :][: PROBE_LAYOUT.object_bytes] for s in slots)
        out[:] = np.frombuffer(os.urandom(out.nbytes), dtype=np.uint8)
        back[:] = ~out  # differs everywhere, so a read that moved nothing cannot compare equal
        if store.write([key], [pool.slot_addr(slots[0])]) != [True]:
            raise ProbeFailed(f"writing probe object {key} failed (see the warnings above)")
        try:
            if store.read([key], [pool.slot_addr(slots[1])]) != [True]:
                raise ProbeFailed(f"reading probe object {key} back failed")
            if not np.array_equal(out, back):
                raise ProbeFailed(f"probe object {key} read back different bytes")
        finally:
            store.delete([key])
        if store.lookup([key]) != 0:
            raise ProbeFailed(f"probe object {key} is still there after its delete")
    finally:
        pool.release(slots)
    return f"{PROBE_LAYOUT.object_bytes}-byte probe object written, read back equal, deleted"


def check_stores(agent: Any, target: Target, redact: Redactor, stack: ExitStack) -> Iterator[CheckResult]:
    """Reachable (opened with the engine's credentials), then writable, per store."""
    from nixl_backends.buffers import HostBufferPool
    from nixl_backends.registry import make_store

    opened = []
    for config in _stores(target.store):
        if _is_dualblade(config):
            yield _probe_directory(config)
            continue
        missing = _s3_credentials(config, redact)
        if missing is not None:
            yield missing
            continue
        try:
            store = make_store(config, PROBE_LAYOUT, agent)
        except Exception as exc:  # ConfigError (refused, unreachable), OSError (a root), NIXL errors
            yield _open_failure(config, exc)
            continue
        stack.callback(store.close)
        opened.append((config, store))
        yield CheckResult(f"store {describe(config)}", OK, "reachable" + (
            " with the configured credentials" if hasattr(getattr(config, "s3_config", config), "bucket") else ""))
        if hasattr(config, "gateway"):
            yield _check_gateway(config)
    if not opened:
        return
    # After the stores: a backend must exist on the agent before the pool registers memory with it.
    pool = HostBufferPool(agent, PROBE_LAYOUT.object_bytes, 2)
    for config, store in opened:
        label = f"store {describe(config)} writable"
        try:
            yield CheckResult(label, OK, _probe_store(store, target.key_prefix, pool))
        except OSError as exc:
            yield CheckResult(label, FAIL, f"{type(exc).__name__}: {exc}",
                              f"make the store writable for the engine's user (uid {os.geteuid()})")  # fmt: skip
        except Exception as exc:  # ProbeFailed, TransferAbandoned, NIXL errors
            yield CheckResult(label, FAIL, f"{type(exc).__name__}: {exc}",
                              "check that the credentials may write and delete under the key prefix")  # fmt: skip


def _new_agent(role: str) -> Any:
    """A NIXL agent with no backend, named uniquely as the worker's are: a peer keys what it knows of an agent by
    its name."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"dualpath-doctor-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[]))


def run_checks(target: Target | None, config_results: list[CheckResult], redact: Redactor) -> list[CheckResult]:
    """Every check after the config's (``config_results``: its parse, and what the caller checked of it), in
    order; those needing what failed are skipped."""
    results = list(config_results)
    results.append(check_rdma(target))
    try:
        agent = _new_agent("plugins")
    except Exception as exc:
        results += [CheckResult(f"nixl {name}", FAIL, f"cannot create a NIXL agent: {type(exc).__name__}: {exc}",
                                "install NIXL (pip install nixl)") for name in PLUGINS]  # fmt: skip
        agent = None
    else:
        results += check_plugins(agent, target)
    if target is None:
        results.append(CheckResult("store", SKIP, "the configuration did not parse"))
    elif agent is None:
        results.append(CheckResult("store", SKIP, "no NIXL agent"))
    else:
        # The stores get an agent of their own, with no backend yet, as a kv_both engine's worker has: each store
        # creates what it needs. On the plugin checks' agent an s3agg store would find UCX made already,
        # offering the gateway every interface (also one gone since: a CI run's gateway WRITE hung on one).
        store_agent = _new_agent("stores")
        with ExitStack() as stack:
            results += check_stores(store_agent, target, redact, stack)
    return [redact.result(result) for result in results]


def nixl_logs_to_stderr() -> None:
    """NIXL's Python logger writes to stdout; a command whose stdout is its report (``--json``) moves it to stderr."""
    try:
        import nixl._api  # noqa: F401  (sets the "nixl" logger up on import)
    except ImportError:
        return  # the plugin checks report it
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


# -- reporting -------------------------------------------------------------------------------------------

_MARK = {OK: "OK  ", FAIL: "FAIL", WARN: "WARN", SKIP: "SKIP"}


def format_line(result: CheckResult) -> str:
    line = f"[{_MARK[result.status]}] {result.name}: {result.detail}"
    return f"{line} -> {result.fix}" if result.fix and result.status in (FAIL, WARN) else line


def format_report(results: list[CheckResult], as_json: bool = False) -> str:
    if as_json:
        return json.dumps({"ok": exit_code(results) == 0, "checks": [asdict(r) for r in results]}, indent=2)
    return "\n".join(map(format_line, results))


def exit_code(results: list[CheckResult]) -> int:
    return 1 if any(result.status == FAIL for result in results) else 0


def diagnose_target(document: Any, parse: Callable[[Any], Target], *,
                    checks: Callable[[Target], list[CheckResult]] = lambda target: [],
                    environ: Mapping[str, str] = os.environ) -> list[CheckResult]:  # fmt: skip
    """Every check on a config ``document`` that ``parse`` turns into a :class:`Target` (raising
    :class:`ConfigError` naming the bad key), ``checks`` of the parsed target right after its parse; the
    results, secrets redacted."""
    redact = Redactor(environ)
    redact.add_from_document(document)
    try:
        target = parse(document)
    except ConfigError as exc:
        return run_checks(None, [CheckResult("config", FAIL, str(exc), CONFIG_DOCS)], redact)
    stores = ", ".join(describe(config) for config in _stores(target.store))
    parsed = CheckResult("config", OK, f"parses: kv_role {target.kv_role}, key prefix {target.key_prefix!r}, {stores}")
    return run_checks(target, [parsed, *checks(target)], redact)


def diagnose_store(section: Any, key_prefix: str = "dualpath", environ: Mapping[str, str] = os.environ) -> list[CheckResult]:
    """Every check on a bare store section (as ``dualpath-kv gc`` takes it); the results, secrets redacted.
    A connector configuration is diagnosed by :func:`dualpath_connector.doctor.diagnose`."""
    return diagnose_target(section, lambda document: parse_store_target(document, key_prefix), environ=environ)
