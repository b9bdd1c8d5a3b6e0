"""Helpers shared by the benchmark scripts: medians, markdown tables, JSON results, signals."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def tree_cpu_s(pid: int, descendants: bool = True) -> float:
    """CPU seconds (user + system) of a process and (``descendants``) its live descendants so far; 0 for what is
    gone. A benchmark counting its own process passes ``descendants=False``: the services it started are its
    children."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)] if descendants else [root]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], caption: str = "") -> str:
    """A GitHub markdown table; numbers are right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    text = [line(headers), sep, *(line(r) for r in cells)]
    if caption:
        text = [caption, "", *text]
    return "\n".join(text)


def _is_number(text: str) -> bool:
    try:
        float(text.replace("x", "").replace(",", ""))
    except ValueError:
        return False
    return True


def environment() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_at_start": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_text(path: Path, text: str) -> Path:
    """Write ``path`` atomically: beside it as ``<name>.tmp`` (git ignores it under results/), then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_json(name: str, payload: dict, out_dir: Path = RESULTS_DIR) -> Path:
    """Write ``<out_dir>/<name>`` (default: ``benchmarks/results/``) atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_text(out_dir / name, json.dumps(payload, indent=2, sort_keys=False) + "\n")


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so ``finally`` blocks stop what was started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_and_report(run, table, args, json_name: str, chart=None, out_dir: Path = RESULTS_DIR) -> dict:
    """Run a benchmark, print its table and write its JSON under ``out_dir``; Ctrl-C exits 130 after cleanup.

    ``chart(payload, path)``, if given, draws the PNG beside the JSON (and returns
    None when it cannot, e.g. without matplotlib). A payload's ``environment``
    gets the load average from before and after the run.
    """
    load_at_start = list(os.getloadavg())
    try:
        payload = run(args)
    except KeyboardInterrupt:
        print("interrupted; everything this run started has been stopped", file=sys.stderr)
        sys.exit(130)
    if "environment" in payload:
        # Most runs call environment() once they are done: the load they started under is known only here.
        payload["environment"].update(load_avg_at_start=load_at_start, load_avg_at_end=list(os.getloadavg()))
    text = table(payload)
    payload["table"] = text
    path = write_json(json_name, payload, out_dir)
    print(text)
    print(f"\nresults: {path}")
    if chart is not None and chart(payload, path.with_suffix(".png")) is not None:
        print(f"chart: {path.with_suffix('.png')}")
    return payload


def result_payload(args, **results: object) -> dict:
    """A benchmark's JSON: its options, the machine, then ``results``."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"config": config, "environment": environment(), **results}


# --- vLLM server benchmarks (bench_ttft, bench_injection) ----------------------------------------

VOCAB = 1024  # the tiny Llama's vocabulary
PROBE_TOKENS = 8  # shorter than a chunk: a probe is never looked up and never saved


def add_server_args(parser) -> None:
    """The options every benchmark against vLLM servers takes (see :class:`SaveWaiter`)."""
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the discarded warm-up")
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / ".cache", help="model and vLLM logs go here")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for vLLM to become healthy")
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--save-timeout", type=float, default=120.0, help="seconds to wait for saves to land")
    parser.add_argument("--save-settle", type=float, default=10.0,
                        help="stop waiting when the save counters did not move for this long")
    parser.add_argument("--seed", type=int, default=0)


def add_store_rtt_arg(parser) -> None:
    """``--store-rtt-ms``: the store round trips a benchmark measures at, through :func:`vllm_stack`'s relays."""
    parser.add_argument("--store-rtt-ms", type=float, nargs="+", default=[],
                        help="store round trips to measure at (e.g. 0 5 20): every engine request to S3 and to the "
                             "gateway waits this long in a relay first; default: no relay")


def set_store_rtt(relays: list | None, rtt_ms: float | None) -> None:
    """Every request through ``relays`` (those :func:`vllm_stack` opened) waits ``rtt_ms`` from now on."""
    for relay in relays or ():
        relay.delay_s = rtt_ms / 1000


def start_side_by_side(servers: list, timeout_s: float) -> None:
    """Start servers at once (an engine's start-up is mostly single-threaded imports) and wait until all are
    healthy; the first failure raises at once (the caller's stopping of the others ends their waits)."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    clock = time.monotonic()
    pool = ThreadPoolExecutor(len(servers))
    futures = [pool.submit(server.start, timeout_s) for server in servers]
    pool.shutdown(wait=False)
    for future in wait(futures, return_when=FIRST_EXCEPTION).done:
        future.result()
    print(f"vLLM healthy after {time.monotonic() - clock:.0f}s", file=sys.stderr)


@contextlib.contextmanager
def vllm_stack(args, log_stem: str, servers: dict[str, dict], store: dict | None = None,
               relays: list | None = None, services: dict | None = None):  # fmt: skip
    """SeaweedFS and vLLM servers with the connector on it, all healthy; stopped on exit.

    ``servers`` maps a label to ``VLLMServer`` keyword arguments (``extra``,
    ``vllm_args``...); the servers start side by side and are yielded
    under the same labels. Every server gets ``--max-model-len`` and logs to
    ``<workdir>/<log_stem>[-<label>]-vllm.log``.
    ``store``: keys changed in the connector config's store section (``io_timeout_s``...).
    A server whose kwargs hold ``"s3agg": True`` reads through an ``s3agg-gateway`` (started here
    in front of the same bucket, stopped on exit): its store section becomes ``s3agg`` around it.
    ``relays``: given a list, the engines reach the store (and the gateway) through
    :class:`~dualpath_dev.s3_relay.S3Relay` instances, appended to it, whose ``delay_s`` the caller sets:
    a store and a gateway across a network; the gateway reaches the store directly, as it would run
    beside it. ``services``: given a dict, the S3 server and the gateway started here are put in it under
    ``"s3"`` and ``"gateway"`` (their /metrics, their processes).
    """
    from dualpath_dev.engines import CONFIGS, VLLMServer
    from dualpath_dev.s3_relay import S3Relay
    from dualpath_dev.seaweedfs import SeaweedFS
    from dualpath_dev.tiny_model import make_tiny_llama

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(args.workdir / "tiny-llama")
    s3 = gateway = None
    started: dict = {}
    opened: list = []  # relays, stopped on exit

    def relayed(endpoint: str) -> str:
        if relays is None:
            return endpoint
        relay = S3Relay(endpoint, s3.access_key, s3.secret_key).start()
        opened.append(relay)
        relays.append(relay)
        print(f"relay {relay.endpoint} -> {endpoint}", file=sys.stderr)
        return relay.endpoint

    try:
        s3 = SeaweedFS().start()
        print(f"S3 (SeaweedFS) on {s3.endpoint}", file=sys.stderr)
        if services is not None:
            services["s3"] = s3
        store_endpoint = relayed(s3.endpoint)
        gateway_endpoint = None
        for label, kwargs in servers.items():
            kwargs = dict(kwargs)
            through_gateway = kwargs.pop("s3agg", False)
            if store or through_gateway or relays is not None:
                config = json.loads((CONFIGS / kwargs.get("config", "single.json")).read_text())
                section = {**config["kv_connector_extra_config"]["store"], "endpoint": store_endpoint, **(store or {})}
                if through_gateway:
                    if gateway is None:
                        gateway = _start_gateway(s3, section["bucket"], args.workdir,
                                                 getattr(args, "gateway_min_read_bytes", None))
                        if services is not None:
                            services["gateway"] = gateway
                        gateway_endpoint = relayed(gateway.url)
                    section = {"backend": "s3agg", "gateway": gateway_endpoint, "s3": section}
                kwargs = {**kwargs, "extra": {**kwargs.get("extra", {}), "store": section}}
            log_path = (args.workdir / "-".join(filter(None, (log_stem, label, "vllm.log")))).resolve()
            server = started[label] = VLLMServer(model, s3, log_path, max_model_len=args.max_model_len, **kwargs)
            print(f"vLLM{' ' + label if label else ''} starting on {server.base_url}; log: {log_path}", file=sys.stderr)
        start_side_by_side(list(started.values()), args.start_timeout)
        yield started
    finally:
        for server in started.values():
            server.stop()
        for relay in opened:
            relay.stop()
        if gateway is not None:
            gateway.stop()
        if s3 is not None:
            s3.stop()


def _start_gateway(s3, bucket: str, workdir: Path, min_read_bytes: int | None = None):
    """s3agg-gateway in front of ``bucket``; clients sign with the S3 keys (the engines' AWS variables).

    ``min_read_bytes``: the gateway's smallest ranged GET (None: its default).
    """
    from botocore.exceptions import ClientError

    from dualpath_dev.gateway import GatewayProcess, gateway_config

    with contextlib.suppress(ClientError):  # the engines create it too; whoever is first
        s3.client().create_bucket(Bucket=bucket)
    # theta 1 MiB: a hit of more than a few chunks is delivered layer by layer.
    reads = {} if min_read_bytes is None else {"min_read_bytes": min_read_bytes}
    config = gateway_config(s3, bucket, s3.access_key, s3.secret_key, theta_bytes=1 << 20, io_threads=8,
                            log_level="WARNING", **reads)
    gateway = GatewayProcess(config, workdir).start()
    print(f"s3agg-gateway on {gateway.url}; log: {gateway.log_path}", file=sys.stderr)
    return gateway


def chunk_tokens(server) -> int:
    """Tokens per stored chunk of a server (the connector's default: one 32-token block)."""
    return server.kv_config["kv_connector_extra_config"].get("chunk_tokens", 32)


def ttft_caption(payload: dict) -> str:
    """The first sentence of every TTFT table's caption: what ran, how often, where hits came from."""
    return (
        f"TTFT on vLLM's CPU build ({payload['environment']['cpu_count']} cores, tiny random Llama, bf16, "
        f"max_tokens=1), median of {payload['config']['reps']} repetition(s) with fresh random prompts each; "
        f"local prefix cache off, so every hit token was loaded from S3 (SeaweedFS on 127.0.0.1)."
    )


def store_traffic(server) -> dict[str, float]:
    """The connector's store counters of one server, from its ``/metrics``."""
    names = ("bytes_read_total", "bytes_written_total", "loaded_tokens_total", "load_failed_tokens_total")
    return {name: server.metric_total(f"dualpath_kv:{name}") for name in names}


def _save_counters(server) -> tuple[int, int]:
    return (
        int(server.metric_total("dualpath_kv:saved_chunks_total")),
        int(server.metric_total("dualpath_kv:save_skipped_chunks_total")),
    )


class SaveWaiter:
    """Waits for one server's store saves to land, so they never overlap a timed request."""

    def __init__(self, server, args, fresh) -> None:
        self.server = server
        self.args = args
        self.fresh = fresh  # n -> n never-seen token ids
        self.saved, self.skipped = _save_counters(server)

    def wait(self, expected_new: int) -> dict:
        """Wait until ``expected_new`` more chunks were saved (or skipped) since the last wait.

        The connector's counters reach ``/metrics`` only with an engine step, and
        a save finishes on the save lane after the step that planned it; an idle
        engine would never report it. So while the counters lag, a tiny probe
        request (shorter than one chunk: never looked up, never saved) makes the
        engine step. Gives up after ``--save-timeout`` seconds; also returns when
        the counters stop increasing for ``--save-settle`` seconds of probing.
        """
        started = time.monotonic()
        target = self.saved + self.skipped + expected_new
        last_total, last_change = -1, started
        probes = 0
        while True:
            saved, skipped = _save_counters(self.server)
            total = saved + skipped
            now = time.monotonic()
            if total != last_total:
                last_total, last_change = total, now
            if total >= target:
                status = "landed"
                break
            if now - started > self.args.save_timeout:
                status = "timeout"
                break
            if now - last_change > self.args.save_settle:
                status = "stopped increasing"
                break
            time.sleep(0.2)
            self.server.complete(self.fresh(PROBE_TOKENS), 1, self.args.request_timeout)
            probes += 1
        info = {
            "expected_chunks": expected_new,
            "saved_chunks": saved - self.saved,
            "skipped_chunks": skipped - self.skipped,
            "wait_s": round(time.monotonic() - started, 3),
            "probes": probes,
            "status": status,
        }
        self.saved, self.skipped = saved, skipped
        if status != "landed" or info["skipped_chunks"]:
            print(f"  warning: save wait {info}", file=sys.stderr)
        return info


def size_label(tokens: int) -> str:
    """2048 -> '2k', 8000 -> '8k', 1800 -> '1800'."""
    for unit in (1024, 1000):
        if tokens % unit == 0:
            return f"{tokens // unit}k"
    return str(tokens)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; None when matplotlib is not installed (no chart)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` (tight layout, 120 dpi) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bar_chart(path: Path, labels: Sequence[str], series: dict[str, Sequence[float]], xlabel: str, title: str,
              ylabel: str = "median TTFT (ms)") -> Path | None:
    """Grouped bars, one group per label and one bar per series; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(6.4 + 0.8 * max(0, len(series) - 2), 4.0))
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        bars = ax.bar([x + offset for x in range(len(labels))], values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(list(range(len(labels))), labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, path)
