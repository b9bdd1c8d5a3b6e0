"""What the simulated cluster is made of: links, compute and decode speeds, with the paper's numbers as a preset.

Every figure of a preset carries its source in :attr:`SimHardware.sources`: a section of the DualPath
paper (arXiv 2602.21548), a file of ours, or "assumption" with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from dualpath_bench.errors import BenchUsageError


@dataclass(frozen=True)
class SimHardware:
    name: str
    gpus_per_node: int  # g
    engines_per_node: int  # a node's GPUs are split evenly among its engines
    storage_bytes_per_s: float  # a node's storage NIC, reads (s x B)
    cnic_bytes_per_s: float  # one GPU's compute NIC, each direction (B)
    dram_bytes_per_s: float  # a node's memory bandwidth, reads + writes (M)
    kv_bytes_per_token: float
    # Prefill on one GPU: new x (linear + attention x (cached + new / 2)) seconds.
    linear_s_per_token: float
    attention_s_per_pair: float
    tpot_s: float  # one decode step (every request of a DE is in its batch, §6.2)
    request_overhead_s: float  # per turn, outside read, prefill and decode (router, PD handoff)
    block_tokens: int  # hits are whole blocks
    # The context the router's starting prefill rate (beta) is profiled at (§A.4: profiled in advance).
    profile_context_tokens: int
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "engines_per_node", "storage_bytes_per_s", "cnic_bytes_per_s",
                     "dram_bytes_per_s", "kv_bytes_per_token", "linear_s_per_token", "block_tokens"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise BenchUsageError(f"hardware.{name} must be positive, got {getattr(self, name)}")
        for name in ("attention_s_per_pair", "tpot_s", "request_overhead_s"):
            if getattr(self, name) < 0:
                raise BenchUsageError(f"hardware.{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_node % self.engines_per_node:
            raise BenchUsageError(f"hardware.engines_per_node ({self.engines_per_node}) must divide "
                                  f"gpus_per_node ({self.gpus_per_node})")  # fmt: skip

    @property
    def gpus_per_engine(self) -> int:
        return self.gpus_per_node // self.engines_per_node

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """One engine's compute time for a request; attention grows with the context."""
        pairs = new_tokens * (cached_tokens + new_tokens / 2)
        return (new_tokens * self.linear_s_per_token + pairs * self.attention_s_per_pair) / self.gpus_per_engine

    def prefill_tokens_per_s(self, context_tokens: int) -> float:
        """One engine's rate at ``context_tokens`` of context: the router's beta, profiled in advance (§A.4)."""
        return 1.0 / (self.prefill_s(1, context_tokens))

    def scaled(self, compute: float) -> SimHardware:
        """Compute and decode ``compute`` times faster: leaves the links as the only limit."""
        return replace(self, name=f"{self.name}, compute x{compute:g}", linear_s_per_token=self.linear_s_per_token / compute,
                       attention_s_per_pair=self.attention_s_per_pair / compute, tpot_s=self.tpot_s / compute,
                       request_overhead_s=self.request_overhead_s / compute)  # fmt: skip


def _paper() -> SimHardware:
    # DeepSeek V3.2 (DS 660B, the model of the paper's scaling runs, §7.6).
    kv_bytes = 61 * 656
    context, append = 32_700, 429  # §3: the coding trace's mean context and append
    cache_compute_bytes_per_flop = 22e9 / 1e15  # §3: ~22 GB/PFLOP for DeepSeek-V3.2 at that context and append
    flops_per_new_token = context * kv_bytes / cache_compute_bytes_per_flop / append
    linear_flops = 2 * 37e9
    attention_flops = (flops_per_new_token - linear_flops) / (context + append / 2)
    gpu_flops = 1979e12 * 0.3
    return SimHardware(
        name="paper", gpus_per_node=8, engines_per_node=8, storage_bytes_per_s=50e9, cnic_bytes_per_s=50e9,
        dram_bytes_per_s=500e9, kv_bytes_per_token=kv_bytes, linear_s_per_token=linear_flops / gpu_flops,
        attention_s_per_pair=attention_flops / gpu_flops, tpot_s=0.030, request_overhead_s=0.0, block_tokens=64,
        profile_context_tokens=context,
        sources={
            "gpus_per_node": "§2.3, §7.2: 8 Hopper GPUs per node",
            "engines_per_node": "§4: each engine manages one GPU",
            "storage_bytes_per_s": "§7.2: one 400 Gbps storage NIC per node that 3FS saturates; §4.2: Bs ~ 50 GB/s",
            "cnic_bytes_per_s": "§7.2: eight 400 Gbps RDMA NICs per node, one per GPU (§2.3)",
            "dram_bytes_per_s": "§4.2: M ~ 500 GB/s",
            "kv_bytes_per_token": "assumption, not in our copy of the paper: DeepSeek-V3.2's FP8 MLA cache, "
                                  "656 B/token/layer (FlashMLA's layout) x 61 layers = 40,016 B",
            "linear_s_per_token": "2 x 37e9 FLOP (DeepSeek-V3's activated parameters, its technical report) "
                                  "on a Hopper at 1979 TFLOPS FP8 dense x 0.3 MFU (assumption)",
            "attention_s_per_pair": "the rest of §3's 22 GB/PFLOP cache-compute ratio at 32.7k context and 429 "
                                    "appended tokens, spread over (context + append/2) pairs per token",
            "tpot_s": "assumption: 30 ms, inside §7.4's 50 ms TPOT SLO",
            "request_overhead_s": "not modelled",
            "block_tokens": "§4.1: a full block of 64 tokens",
            "profile_context_tokens": "§3: the coding trace's mean context, 32.7k",
            "scheduling": "§A.4: alpha = 3 s of reads, beta = 5 s of one GPU's prefill (the router's defaults)",
        },
    )  # fmt: skip


# The measured run the emulated preset takes its figures and its trace from (make bench-dualpath's 1P1D run).
EMULATED_RUN = "dualpath-bench.json"


def emulated_run(measured_dir: Path) -> dict:
    """The measured emulated-cluster run the ``emulated`` preset is made of (``EMULATED_RUN`` in ``measured_dir``)."""
    path = Path(measured_dir) / EMULATED_RUN
    if not path.is_file():
        raise BenchUsageError(f"the emulated preset takes its figures from {path}, which is not there (--measured-dir)")
    payload = json.loads(path.read_text())
    if "trace_config" not in payload or not any(t["topology"] == "1P1D" and "summary" in t["runs"].get("basic", {})
                                                for t in payload["topologies"]):  # fmt: skip
        raise BenchUsageError(f"{path}: the emulated preset needs its trace_config and a Basic 1P1D run")
    return payload


def _emulated(measured_dir: Path) -> SimHardware:
    # The emulated cluster of benchmarks/results/dualpath-bench*.json (make bench-dualpath): one vLLM CPU
    # engine per network namespace ("node"), a storage NIC of storage_mbit each, the compute network unshaped.
    # The engine figures are read from the Basic 1P1D run of EMULATED_RUN, so the prediction of the DualPath
    # runs and of the other topologies is out of sample.
    payload = emulated_run(measured_dir)
    basic = next(t["runs"]["basic"] for t in payload["topologies"] if t["topology"] == "1P1D")
    storage_mbit = payload["config"]["cluster"]["storage_mbit"]
    compute_mbit = payload["config"]["cluster"]["compute_mbit"]  # 0: the compute network is unshaped
    compute = basic["cache_compute"]
    tpot_s = basic["summary"]["tpot_s"]["p50"]
    other_s = basic["ttft_breakdown"]["other_s"]
    context = payload["trace"]["context"]
    return SimHardware(
        name="emulated", gpus_per_node=1, engines_per_node=1, storage_bytes_per_s=storage_mbit * 1e6 / 8,
        cnic_bytes_per_s=compute_mbit * 1e6 / 8 if compute_mbit else 1e9, dram_bytes_per_s=10e9,
        kv_bytes_per_token=compute["bytes_per_token"],
        linear_s_per_token=1 / compute["prefill_tokens_per_s"], attention_s_per_pair=0.0, tpot_s=tpot_s,
        request_overhead_s=other_s, block_tokens=32, profile_context_tokens=round(context),
        sources={
            "gpus_per_node": "one vLLM CPU engine per network namespace (dualpath_dev/cluster.py)",
            "engines_per_node": "one engine per namespace",
            "storage_bytes_per_s": f"{EMULATED_RUN} config.cluster.storage_mbit = {storage_mbit:g}",
            "cnic_bytes_per_s": f"{EMULATED_RUN} config.cluster.compute_mbit = {compute_mbit:g}"
                                + (" (unshaped veth): 1 GB/s, never the limit" if not compute_mbit else ""),
            "dram_bytes_per_s": "not a limit on the emulated cluster: 10 GB/s",
            "kv_bytes_per_token": f"{EMULATED_RUN} Basic 1P1D: cache_compute.bytes_per_token = "
                                  f"{compute['bytes_per_token']:g}",
            "linear_s_per_token": f"{EMULATED_RUN} Basic 1P1D: cache_compute.prefill_tokens_per_s = "
                                  f"{compute['prefill_tokens_per_s']:.1f} (vLLM's own prefill time)",
            "attention_s_per_pair": "the tiny test model's attention is negligible at 8k context",
            "tpot_s": f"{EMULATED_RUN} Basic 1P1D: summary.tpot_s.p50 = {tpot_s * 1000:.1f} ms",
            "request_overhead_s": f"{EMULATED_RUN} Basic 1P1D: ttft_breakdown.other_s = {other_s:.2f} s "
                                  "(router, PD pull, DE first step)",
            "block_tokens": "the engines' vLLM block size (dualpath_dev/engines.py: --block-size 32)",
            "profile_context_tokens": f"{EMULATED_RUN} trace.context = {context:.0f}",
        },
    )  # fmt: skip


PRESETS = ("paper", "emulated")


def preset(name: str, measured_dir: Path | None = None) -> SimHardware:
    """A preset by name; ``emulated`` reads its figures from ``EMULATED_RUN`` in ``measured_dir``
    (default: the checkout's ``benchmarks/results``)."""
    if name not in PRESETS:
        raise BenchUsageError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    if name == "paper":
        return _paper()
    return _emulated(measured_dir or Path(__file__).resolve().parents[2] / "benchmarks" / "results")
