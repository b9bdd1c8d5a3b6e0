"""An emulated DualPath cluster on one machine: network namespaces, veth pairs and tc rate limits.

Topology (``<p>`` is a per-run prefix, ``<s>`` the /16, e.g. ``10.213``)::

    root namespace: harness, dualpath-router
      |- bridge <p>br  <s>.1.1/24 ............ "compute network" (unlimited, or compute_mbit)
      |     |- veth <p>c<k>b  <->  <p>c<k>a  <s>.1.<10+k>   in namespace <p>-pe<i> / <p>-de<j>
      |- veth <p>x0 <s>.0.1/30 <-> <p>x1 <s>.0.2  in <p>-s3 . control link: router lookups, harness
    namespace <p>-s3: SeaweedFS on 0.0.0.0 (and, with store_rtt_ms, a delaying S3 relay in front of it)
      |- veth <p>s<k>b <s>.<16+k>.1/30 <-> <p>s<k>a <s>.<16+k>.2 in node k ..... "storage NIC" (storage_mbit)

Every engine namespace reaches S3 only through its own storage link, shaped
with an htb class in both directions (S3 -> node on ``<p>s<k>b``: reads; node
-> S3 on ``<p>s<k>a``: writes), and the other engines only through the
bridge. Engines run under ``ip netns exec``; NIXL's UCX is pinned to TCP on the
compute interface so PE <-> DE transfers take the compute link. The router runs
in the root namespace and reaches S3 through the control link, which carries
only hit lookups.

``store_rtt_ms`` > 0 puts a store round trip on every engine and router
request: one S3 relay process (``dualpath_dev.s3_relay``) runs in the S3
namespace in front of SeaweedFS, listening on every address there, and the
engines' and the router's store endpoints name it (same addresses, its port),
so reads, writes and the router's lookups each wait that long before they are
forwarded, and the bytes still cross each node's shaped storage link. The
harness's own waits for stored chunks go to SeaweedFS directly: they are the
measurement's, not the system's. A relay rather than a delaying qdisc: this
machine's kernel has no netem.

Teardown (``ClusterNetwork.teardown``) is idempotent and runs on exit, on an
exception and on SIGINT/SIGTERM (the CLI turns SIGTERM into ``SystemExit``);
SIGINT/SIGTERM arriving while it runs are held and raised afterwards, so a
second Ctrl-C cannot leave half a network.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from dualpath_dev.engines import ClusterKeys, RouterProcess, VLLMServer
from dualpath_dev.s3_relay import S3RelayProcess
from dualpath_dev.seaweedfs import SeaweedFS

from dualpath_bench.errors import BenchUsageError

logger = logging.getLogger(__name__)

PREFIX_RE = re.compile(r"^dpb[0-9a-z]{1,5}$")
BUCKET = "dualpath-bench"
# The engines' store.io_timeout_s here. A write past it is abandoned, and its chunks are never stored: the
# replay, waiting for them before the agent's next turn, then fails the agent. The default (30 s) is below what
# the AWS SDK under NIXL OBJ spends on one request it retries (10 s without an answer, then again, up to 11
# times); on a loaded 2-core host a burst of PUTs through the relay once took 31 s (CI, 2026-11-29).
STORE_IO_TIMEOUT_S = 120.0


class ClusterError(BenchUsageError, RuntimeError):
    """The emulated cluster cannot be built here; the message says why."""


@dataclass(frozen=True)
class ClusterConfig:
    """Shape and link rates of the emulated cluster."""

    prefill: int = 1
    decode: int = 1
    storage_mbit: float = 16.0
    compute_mbit: float = 0.0  # 0: the compute network is not shaped
    subnet: str = "10.213"  # first two octets of the private /16 the harness owns for the run
    prefix: str = ""  # namespace/link name prefix; empty: a fresh random one
    # The cores SeaweedFS runs on ("1", "0,2-3": taskset's list); empty: wherever Linux puts it. The engines'
    # forwards run on all cores but the last, their transfer threads on the last (processes.forward_threads_env, pinned).
    store_cpus: str = ""
    # Milliseconds every engine and router request to the store waits in a relay before SeaweedFS sees it (a
    # store across a network); 0: no relay, the store answers at the links' pace alone.
    store_rtt_ms: float = 0.0

    def validate(self) -> ClusterConfig:
        if self.prefill < 1 or self.decode < 1:
            raise ClusterError(f"cluster.prefill and cluster.decode must be >= 1, got {self.prefill}, {self.decode}")
        if self.prefill + self.decode > 100:
            raise ClusterError(f"cluster.prefill + cluster.decode must be <= 100, got {self.prefill + self.decode}")
        if self.storage_mbit <= 0:
            raise ClusterError(f"cluster.storage_mbit must be > 0, got {self.storage_mbit}")
        if self.compute_mbit < 0:
            raise ClusterError(f"cluster.compute_mbit must be >= 0 (0: unshaped), got {self.compute_mbit}")
        if not 0 <= self.store_rtt_ms < float("inf"):  # NaN fails this too
            raise ClusterError(f"cluster.store_rtt_ms must be a number >= 0 (0: no relay), got {self.store_rtt_ms}")
        try:
            net = ipaddress.ip_network(f"{self.subnet}.0.0/16")
        except ValueError:
            raise ClusterError(f"cluster.subnet must be two octets like '10.213', got {self.subnet!r}") from None
        if not net.is_private:
            raise ClusterError(f"cluster.subnet {net} is not a private range")
        if self.prefix and not PREFIX_RE.match(self.prefix):
            raise ClusterError(f"cluster.prefix must match {PREFIX_RE.pattern} (interface names), got {self.prefix!r}")
        if self.store_cpus:
            allowed = sorted(os.sched_getaffinity(0))
            cpus = cpu_list(self.store_cpus)
            if cpus is None or not cpus <= set(allowed):
                raise ClusterError(f"cluster.store_cpus must list cores of {allowed} like '1' or '0,2-3', "
                                   f"got {self.store_cpus!r}")  # fmt: skip
        return self

    @property
    def store_launcher(self) -> list[str]:
        """The command prefix that keeps the store server on ``store_cpus`` (none when unpinned)."""
        return ["taskset", "-c", self.store_cpus] if self.store_cpus else []

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.subnet}.0.0/16")


def cpu_list(text: str) -> set[int] | None:
    """The cores a list like ``"0,2-3"`` names; None if it is not one."""
    cores: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            return None
        cores.update(range(int(low), int(high if dash else low) + 1))
    return cores


@dataclass(frozen=True)
class Node:
    """One engine's namespace and its two links."""

    name: str  # pe0, de1...
    role: str  # prefill | decode
    index: int  # k: position among all nodes, names its links and addresses
    namespace: str
    compute_if: str
    compute_peer_if: str  # the same link's end on the bridge (root namespace)
    compute_addr: str
    storage_if: str  # in the node's namespace
    storage_peer_if: str  # the same link's end in the S3 namespace
    s3_addr: str  # S3's address on this node's storage link

    @property
    def launcher(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM until the block ends, then deliver them (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: pending.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def _ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout


def netns_supported() -> tuple[bool, str]:
    """Whether this process may create network namespaces; the reason when not."""
    name = f"dpbprobe{secrets.token_hex(3)}"
    try:
        result = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    except FileNotFoundError:
        return False, "iproute2's `ip` is not installed"
    if result.returncode != 0:
        return False, f"`ip netns add` refused: {result.stderr.strip() or result.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True, ""


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose name starts with ``prefix`` (empty when clean)."""
    names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    links = [json_link["ifname"] for json_link in json.loads(_ip("-j", "link", "show") or "[]")]
    return [n for n in names + links if n.startswith(prefix)]


def remove(prefix: str) -> list[str]:
    """Delete the namespaces (killing what runs in them) and links named ``prefix``*; what is left.

    Only for a prefix this harness made: its namespaces, and so their processes, are the run's own.
    """
    if not PREFIX_RE.match(prefix):
        raise ClusterError(f"refusing to remove {prefix!r}: not a dualpath-bench prefix ({PREFIX_RE.pattern})")
    names = set(leftovers(prefix))
    namespaces = [n for n in _ip("netns", "list").split() if n in names]
    for namespace in namespaces:
        # The services stop their own process groups; this catches a child that escaped its group.
        result = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        for pid in (int(p) for p in result.stdout.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # Deleting a namespace deletes its veth ends, and with them their peers.
        _quiet("ip", "netns", "del", namespace)
    for link in leftovers(prefix):
        _quiet("ip", "link", "del", link)
    return leftovers(prefix)


def _check_subnet_unused(network: ipaddress.IPv4Network) -> None:
    for entry in json.loads(_ip("-j", "-4", "addr", "show") or "[]"):
        for addr in entry.get("addr_info", []):
            if ipaddress.ip_interface(f"{addr['local']}/{addr['prefixlen']}").network.overlaps(network):
                raise ClusterError(
                    f"{network} is in use here ({addr['local']}/{addr['prefixlen']} on {entry['ifname']}); "
                    f"pick another --subnet (another bench run may hold it)"
                )
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            try:
                routed = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
            except ValueError:
                continue
            if routed.overlaps(network):
                raise ClusterError(f"{network} overlaps route {dst} here; pick another --subnet")


class ClusterNetwork:
    """Namespaces, links, addresses and rate limits of one run; a context manager that always tears down."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config.validate()
        self.prefix = config.prefix or f"dpb{secrets.token_hex(3)[:5]}"
        sub = config.subnet
        self.s3_namespace = f"{self.prefix}-s3"
        self.bridge = f"{self.prefix}br"
        self.control_if, self.control_peer_if = f"{self.prefix}x0", f"{self.prefix}x1"
        self.control_addr, self.s3_control_addr = f"{sub}.0.1", f"{sub}.0.2"
        roles = [("pe", "prefill")] * config.prefill + [("de", "decode")] * config.decode
        counters = {"pe": 0, "de": 0}
        self.nodes: list[Node] = []
        for k, (short, role) in enumerate(roles):
            name = f"{short}{counters[short]}"
            counters[short] += 1
            self.nodes.append(
                Node(
                    name=name, role=role, index=k, namespace=f"{self.prefix}-{name}",
                    compute_if=f"{self.prefix}c{k}a", compute_peer_if=f"{self.prefix}c{k}b",
                    compute_addr=f"{sub}.1.{10 + k}",
                    storage_if=f"{self.prefix}s{k}a", storage_peer_if=f"{self.prefix}s{k}b",
                    s3_addr=f"{sub}.{16 + k}.1",
                )
            )  # fmt: skip
        self._built = False

    @property
    def namespaces(self) -> list[str]:
        return [self.s3_namespace] + [n.namespace for n in self.nodes]

    def build(self) -> ClusterNetwork:
        """Create everything; on any failure what exists is removed before the error propagates."""
        _check_subnet_unused(self.config.network)
        self._built = True  # from here on teardown has something to do
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        logger.info("emulated network %s: %d nodes, storage %g Mbit/s", self.prefix, len(self.nodes),
                    self.config.storage_mbit)  # fmt: skip
        return self

    def _build(self) -> None:
        sub = self.config.subnet
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
            # vLLM, SeaweedFS and torch.distributed talk to themselves over 127.0.0.1.
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{sub}.1.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._veth(self.control_if, None, f"{self.control_addr}/30", self.control_peer_if, self.s3_namespace,
                   f"{self.s3_control_addr}/30")  # fmt: skip
        for node in self.nodes:
            bridge_end = node.compute_peer_if
            self._veth(node.compute_if, node.namespace, f"{node.compute_addr}/24", bridge_end, None, None)
            _ip("link", "set", bridge_end, "master", self.bridge)
            self._veth(node.storage_if, node.namespace, f"{sub}.{16 + node.index}.2/30",
                       node.storage_peer_if, self.s3_namespace, f"{node.s3_addr}/30")  # fmt: skip
            self._shape(node.namespace, node.storage_if, self.config.storage_mbit)
            self._shape(self.s3_namespace, node.storage_peer_if, self.config.storage_mbit)
            if self.config.compute_mbit:
                self._shape(node.namespace, node.compute_if, self.config.compute_mbit)
                self._shape(None, bridge_end, self.config.compute_mbit)

    @staticmethod
    def _veth(a: str, a_ns: str | None, a_addr: str | None, b: str, b_ns: str | None, b_addr: str | None) -> None:
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        for name, namespace, addr in ((a, a_ns, a_addr), (b, b_ns, b_addr)):
            if namespace:
                _ip("link", "set", name, "netns", namespace)
            where = ["-n", namespace] if namespace else []
            if addr:
                _ip(*where, "addr", "add", addr, "dev", name)
            _ip(*where, "link", "set", name, "up")

    @staticmethod
    def _shape(namespace: str | None, interface: str, mbit: float) -> None:
        for command in htb_shaping(interface, mbit):
            tc(namespace, *command)

    def teardown(self) -> None:
        """Remove every namespace and link of this run (and any process still in them); idempotent."""
        if not self._built:
            return
        with signals_deferred():
            remaining = remove(self.prefix)
            if remaining:
                logger.error("teardown of %s left %s", self.prefix, remaining)
            self._built = bool(remaining)

    def __enter__(self) -> ClusterNetwork:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.teardown()


def htb_shaping(interface: str, mbit: float) -> list[list[str]]:
    """The tc commands that shape ``interface``'s egress to ``mbit``: one htb class 1:10 as the default.

    htb queues instead of dropping (tbf would drop at a full bucket and make TCP saw-tooth below the rate).
    """
    rate = f"{mbit}mbit"
    return [
        ["qdisc", "add", "dev", interface, "root", "handle", "1:", "htb", "default", "10"],
        ["class", "add", "dev", interface, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate,
         "quantum", "1514"],
    ]  # fmt: skip


def tc(namespace: str | None, *args: str) -> None:
    """Run ``tc args`` in ``namespace`` (None: this one); a failure raises :class:`ClusterError` with tc's message."""
    command = (["ip", "netns", "exec", namespace] if namespace else []) + ["tc", *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def _quiet(*command: str) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True)
    # A veth end disappears with its peer's namespace, possibly after it was listed.
    if result.returncode != 0 and "Cannot find device" not in result.stderr:
        logger.warning("`%s` failed: %s", " ".join(command), result.stderr.strip())


@dataclass
class NicSample:
    t: float  # monotonic seconds
    read_bytes: list[int]  # per node: S3 -> node on its storage link
    write_bytes: list[int]  # per node: node -> S3
    # Per core of this machine ("cpu0", ...): (busy, all) clock ticks since boot. On a box this small the engines,
    # the store and the router share the cores, and a link that moves less than its rate may be waiting for one.
    cpu_ticks: dict[str, tuple[int, int]] = field(default_factory=dict)


def cpu_ticks(stat: str = "/proc/stat") -> dict[str, tuple[int, int]]:
    """Each online core's (busy, all) ticks from ``/proc/stat``, by its name there (``cpu<n>``, taskset's n)."""
    ticks = {}
    with open(stat) as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu":
                counts = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
                ticks[name] = (sum(counts) - counts[3] - counts[4], sum(counts))  # idle and iowait: not busy
    return ticks


class NicSampler:
    """Storage-link byte counters of every node (and this machine's cores' ticks), sampled every ``interval_s``.

    The counters are read inside the S3 namespace (the S3 ends of all storage
    links live there) by one long-lived shell whose builtin ``read`` opens each
    sysfs file, so a sample costs no process start.
    """

    def __init__(self, network: ClusterNetwork, interval_s: float = 0.5) -> None:
        self.network = network
        self.interval_s = interval_s
        self.samples: list[NicSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shell: subprocess.Popen[str] | None = None
        files = []
        for node in network.nodes:
            base = f"/sys/class/net/{node.storage_peer_if}/statistics"
            files += [f"{base}/tx_bytes", f"{base}/rx_bytes"]
        self._files = files
        script = 'while read _; do for f in "$@"; do read v < "$f"; echo "$v"; done; done'
        self._command = ["ip", "netns", "exec", network.s3_namespace, "sh", "-c", script, "sh", *files]

    def sample(self) -> NicSample:
        assert self._shell is not None and self._shell.stdin and self._shell.stdout
        self._shell.stdin.write("\n")
        self._shell.stdin.flush()
        values = [int(self._shell.stdout.readline()) for _ in self._files]
        return NicSample(time.monotonic(), values[0::2], values[1::2], cpu_ticks())

    def start(self) -> NicSampler:
        self._shell = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.samples = [self.sample()]
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="nic-sampler", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.sample())

    def stop(self) -> list[NicSample]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._shell is not None:
            self.samples.append(self.sample())
            self._shell.stdin.close()
            self._shell.wait()
            self._shell = None
        return self.samples

    def __enter__(self) -> NicSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class EngineSpec:
    """What differs between runs on the same network: connector keys and environment."""

    extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    # In the engines' log names, so a restart does not overwrite the last run's logs.
    name: str = "io"


class EmulatedCluster:
    """The network, SeaweedFS in its namespace (behind a delaying relay with ``store_rtt_ms``), and one vLLM
    engine per node; all stopped on exit."""

    def __init__(self, config: ClusterConfig, workdir: Path, model: Path, max_model_len: int = 8192,
                 start_timeout_s: float = 900.0) -> None:  # fmt: skip
        self.network = ClusterNetwork(config)
        self.workdir = workdir
        self.model = model
        self.max_model_len = max_model_len
        self.start_timeout_s = start_timeout_s
        self.s3: SeaweedFS | None = None
        self.relay: S3RelayProcess | None = None
        self.engines: dict[str, VLLMServer] = {}
        self.router: RouterProcess | None = None
        # One per cluster, random per run: the engines' API key and the side channel's key.
        self.keys = ClusterKeys.generate()

    @property
    def prefill(self) -> list[VLLMServer]:
        return [self.engines[n.name] for n in self.network.nodes if n.role == "prefill"]

    @property
    def decode(self) -> list[VLLMServer]:
        return [self.engines[n.name] for n in self.network.nodes if n.role == "decode"]

    def __enter__(self) -> EmulatedCluster:
        self.network.build()
        try:
            self.s3 = SeaweedFS(
                self.workdir / f"{self.network.prefix}-s3",
                host=self.network.s3_control_addr,
                bind="0.0.0.0",
                launcher=["ip", "netns", "exec", self.network.s3_namespace, *self.network.config.store_launcher],
            ).start()
            self.s3.client().create_bucket(Bucket=BUCKET)
            config = self.network.config
            if config.store_rtt_ms > 0:
                self.relay = S3RelayProcess(
                    f"http://127.0.0.1:{self.s3.s3_port}", self.workdir / f"{self.network.prefix}-s3-relay.log",
                    listen_host="0.0.0.0", delay_ms=config.store_rtt_ms,
                    launcher=["ip", "netns", "exec", self.network.s3_namespace, *config.store_launcher],
                ).start()  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    @property
    def store_port(self) -> int:
        """The port the engines and the router reach the store on: the relay's, where there is one."""
        assert self.s3 is not None, "start the cluster first"
        return self.relay.port if self.relay is not None else self.s3.s3_port

    @property
    def store_endpoint(self) -> str:
        """The store as the root namespace (the router) reaches it: over the control link."""
        return f"http://{self.network.s3_control_addr}:{self.store_port}"

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with signals_deferred():
            self.stop_router()
            self.stop_engines()
            if self.relay is not None:
                self.relay.stop()
                self.relay = None
            if self.s3 is not None:
                self.s3.stop()
                self.s3 = None
            self.network.teardown()

    def store_section(self, endpoint: str) -> dict:
        return {"backend": "s3", "endpoint": endpoint, "bucket": BUCKET, "addressing_style": "path",
                "io_timeout_s": STORE_IO_TIMEOUT_S}

    def start_engines(self, spec: EngineSpec) -> None:
        """Start one engine per node (side by side); the first failure stops all and raises."""
        assert self.s3 is not None, "start the cluster first"
        self.stop_engines()
        for node in self.network.nodes:
            extra = {
                "store": self.store_section(f"http://{node.s3_addr}:{self.store_port}"),
                "side_channel_host": node.compute_addr,
                **spec.extra,
            }
            server = VLLMServer(
                self.model, self.s3, self.workdir / f"{self.network.prefix}-{node.name}-{spec.name}-vllm.log",
                max_model_len=self.max_model_len, config="pe.json" if node.role == "prefill" else "de.json",
                extra=extra, host=node.compute_addr, launcher=node.launcher, keys=self.keys, pin_forwards=True,
            )  # fmt: skip
            server.env.update(
                {
                    # PE <-> DE transfers over the compute link only (no shared memory, no storage link).
                    "UCX_TLS": "tcp",
                    "UCX_NET_DEVICES": node.compute_if,
                    "VLLM_HOST_IP": node.compute_addr,
                    "GLOO_SOCKET_IFNAME": "lo",
                    "VLLM_NO_USAGE_STATS": "1",
                    "HF_HUB_OFFLINE": "1",
                    **spec.env,
                }
            )
            self.engines[node.name] = server
        pool = ThreadPoolExecutor(len(self.engines))
        futures = [pool.submit(s.start, self.start_timeout_s) for s in self.engines.values()]
        pool.shutdown(wait=False)
        try:
            for future in wait(futures, return_when=FIRST_EXCEPTION).done:
                future.result()
        except BaseException:
            self.stop_engines()
            raise

    def stop_engines(self) -> None:
        for server in self.engines.values():
            server.stop()
        self.engines = {}

    def start_router(self, policy: str, **overrides: object) -> RouterProcess:
        assert self.s3 is not None
        self.stop_router()
        self.router = RouterProcess(
            self.prefill, self.decode, self.s3, self.workdir, policy=policy,
            store=self.store_section(self.store_endpoint), **overrides,
        ).start()  # fmt: skip
        return self.router

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
