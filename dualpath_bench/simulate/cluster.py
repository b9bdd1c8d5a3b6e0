"""One simulated run: agents' turns placed by the router's own Dispatcher/Policy on modelled engines.

A turn's life, every step an event in simulated time:

1. it joins the router's queue; the head of the queue is placed with ``Dispatcher.try_place`` (the
   router's placement, booking included) until the policy finds every PE over beta;
2. its hit (the context in whole blocks) is read on the chosen side: every link of that read path
   (:func:`dualpath_bench.simulate.links.hit_legs`) carries the bytes; Oracle reads nothing (§7.2);
3. the PE computes the new tokens when the read is done, one request at a time;
4. the PE's answer is booked with ``finish_prefill``; the DE decodes ``output_tokens`` steps and the
   decode is booked with ``finish_decode``; the agent's next turn starts at once (offline, §7.3), or
   once the chunks it will hit are stored: the PE saves the prompt blocks it computed and the DE the
   blocks decoding completed, each through its own node's storage NIC (the write direction).

A PE-side read goes where the connector sends it (:func:`dualpath_connector.load.plan.plan_read`,
with the connector's default settings): read on the PE, moved whole to the DE when the PE's storage NIC
is busy with earlier reads, or split, the DE reading the tail while the PE reads the head; the DE takes
what it is offered only if its own NIC would finish it sooner (``move_queued_reads``,
``split_read_min_tokens``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dualpath_connector.load.plan import DE_READ_TIMEOUT_S, SPLIT_READ_MIN_TOKENS, plan_read
from dualpath_router.accounting import Accounting, EngineLoad, ThroughputEstimate
from dualpath_router.config import EngineConfig, RouterConfig, SchedulingConfig
from dualpath_router.dispatcher import Dispatcher, Placement
from dualpath_router.lookup import HitLookup
from dualpath_router.policies import make_policy
from nixl_backends.rates import RateEstimate

from dualpath_bench.errors import BenchUsageError
from dualpath_bench.simulate.events import EventLoop
from dualpath_bench.simulate.hardware import SimHardware
from dualpath_bench.simulate.links import GpuLinks, Link, NodeLinks, hit_legs
from dualpath_bench.simulate.prefill_steps import NodeStepper, PrefillSteps

MODES = ("basic", "dualpath", "oracle")
# Oracle is DualPath without any KV I/O (§7.2).
_POLICY = {"basic": "basic", "dualpath": "dualpath", "oracle": "dualpath"}


@dataclass
class Turn:
    agent: int
    index: int
    prompt_tokens: int
    hit_tokens: int
    output_tokens: int
    placement: Placement | None = None
    # When every chunk the agent's next turn will hit is in the store.
    stored_at: float = 0.0


@dataclass
class RunResult:
    mode: str
    prefill_nodes: int
    decode_nodes: int
    agents: int
    turns: int
    jct_s: float
    agent_mean_s: float  # mean over agents of their last turn's end: the JCT without the slowest agent's tail
    hit_bytes: float
    read_sides: dict[str, int]
    link_bytes: dict[str, float]  # per link
    utilisation: dict[str, float]  # per link kind: mean over the links of that kind
    utilisation_max: dict[str, float]  # per link kind: the busiest link of that kind
    placements: int
    placement_s: float  # wall time spent in the router's try_place / finish_* calls
    events: int
    wall_s: float
    side_bytes: dict[str, float] = field(default_factory=dict)  # hit bytes read per side
    moved_reads: int = 0  # PE-side reads the PE's busy link moved to the DE
    split_reads: int = 0  # PE-side reads split: the DE read the tail
    saved_bytes: float = 0.0
    prefill_steps: dict = field(default_factory=dict)  # with PrefillSteps: the PE nodes' step times

    @property
    def placements_per_s(self) -> float:
        return self.placements / self.placement_s if self.placement_s > 0 else 0.0

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "link_bytes"}
        out["placements_per_s"] = self.placements_per_s
        return out


def _node(hw: SimHardware, name: str) -> NodeLinks:
    return NodeLinks(Link(f"{name}/storage", "storage NIC, reads", hw.storage_bytes_per_s),
                     Link(f"{name}/dram", f"{name[:2].upper()} DRAM", hw.dram_bytes_per_s),
                     Link(f"{name}/storage-write", "storage NIC, writes", hw.storage_bytes_per_s))  # fmt: skip


def _gpu(hw: SimHardware, name: str, role: str) -> GpuLinks:
    rate = hw.cnic_bytes_per_s * hw.gpus_per_engine
    return GpuLinks(Link(f"{name}/cnic-read", f"{role} compute NIC, reads", rate),
                    Link(f"{name}/cnic-write", f"{role} compute NIC, writes", rate))  # fmt: skip


class Simulation:
    """A cluster of ``prefill_nodes`` + ``decode_nodes`` nodes under one mode, run on one trace."""

    def __init__(self, hw: SimHardware, prefill_nodes: int, decode_nodes: int, mode: str,
                 scheduling: SchedulingConfig | None = None, prefill_steps: PrefillSteps | None = None,
                 split_read_min_tokens: int = SPLIT_READ_MIN_TOKENS) -> None:
        """``prefill_steps``: PEs compute in node-lockstep engine steps (prefill_steps.py), else each
        turn's prefill whole, one at a time per engine. ``split_read_min_tokens``: the connector's
        setting (0: PE-side hits are never split)."""  # fmt: skip
        if mode not in MODES:
            raise BenchUsageError(f"unknown mode {mode!r}; known: {list(MODES)}")
        if prefill_nodes < 1 or decode_nodes < 1:
            raise BenchUsageError("a cluster needs at least one prefill and one decode node")
        self.hw, self.mode = hw, mode
        self.split_read_min_tokens = split_read_min_tokens
        self.prefill_nodes, self.decode_nodes = prefill_nodes, decode_nodes
        self.loop = EventLoop()
        self.nodes: dict[str, NodeLinks] = {}
        self.gpus: dict[str, GpuLinks] = {}
        engines: dict[str, list[EngineConfig]] = {"pe": [], "de": []}
        for role, count in (("pe", prefill_nodes), ("de", decode_nodes)):
            for n in range(count):
                node = f"{role}{n}"
                self.nodes[node] = _node(hw, node)
                for e in range(hw.engines_per_node):
                    name = f"{node}.{e}"
                    self.gpus[name] = _gpu(hw, name, role.upper())
                    engines[role].append(EngineConfig(name, "http://simulated:1", node, "simulated:1"))
        scheduling = scheduling or SchedulingConfig(
            # Profiled in advance (§A.4): a node's read rate, one engine's prefill rate at the mean context.
            read_tokens_per_s=hw.storage_bytes_per_s / hw.kv_bytes_per_token,
            prefill_tokens_per_s=hw.prefill_tokens_per_s(hw.profile_context_tokens),
        )
        config = RouterConfig(engines["pe"], engines["de"], ["simulated"], policy=_POLICY[mode], vocab_size=1,
                              scheduling=scheduling)  # fmt: skip
        config.validate()
        # The router's own books, with simulated time as the read-rate estimate's clock.
        loads = {e.name: EngineLoad(e, "prefill") for e in config.prefill_engines}
        loads.update({e.name: EngineLoad(e, "decode") for e in config.decode_engines})
        accounting = Accounting(
            loads, RateEstimate(scheduling.prefill_tokens_per_s, scheduling.rate_ewma_weight),
            ThroughputEstimate(scheduling.read_tokens_per_s, scheduling.rate_ewma_weight, clock=self.loop.clock),
        )  # fmt: skip
        self.dispatcher = Dispatcher(config, accounting, make_policy(config.policy, scheduling), HitLookup(None, 1))
        self._pes = accounting.role("prefill")
        self._compute_free: dict[str, float] = {e.name: 0.0 for e in self._pes}
        self._stepper = None
        if prefill_steps is not None:
            by_node: dict[str, list[str]] = {}
            for engine in engines["pe"]:
                by_node.setdefault(engine.node, []).append(engine.name)
            self._stepper = NodeStepper(hw, prefill_steps, self.loop, by_node, self._prefilled)
        self._waiting: deque[Turn] = deque()
        self._agents: list[list[tuple[int, int]]] = []
        self._context: list[int] = []
        self._placements = 0
        self._placement_s = 0.0
        self._read_sides = {"pe": 0, "de": 0}
        self._side_bytes = {"pe": 0.0, "de": 0.0}
        self._moved_reads = 0
        self._split_reads = 0
        self._saved_bytes = 0.0
        self.hit_bytes = 0.0
        self.turns_done = 0
        self._agents_done = 0
        self._agent_end_sum = 0.0

    # -- the trace ---------------------------------------------------------------------------------
    def run(self, agents: list[list[tuple[int, int]]], first_turn: int = 0) -> RunResult:
        """Offline (§7.3): every agent starts at time 0; JCT is when the last turn's decode ends.

        ``first_turn`` > 0 runs a window of each trajectory: the turns before it are history whose KV
        is already in the store (agents with no turn left are not run).
        """
        started = time.perf_counter()
        self._agents = agents
        self._context = [sum(a + o for a, o in turns[:first_turn]) for turns in agents]
        for agent in range(len(agents)):
            if len(agents[agent]) > first_turn:
                self.loop.at(0.0, self._start_turn, (agent, first_turn))
        jct = self.loop.run()
        if self._waiting:
            raise RuntimeError(f"{len(self._waiting)} turns never placed")  # a policy bug, not a load
        return self._result(jct, time.perf_counter() - started)

    def _start_turn(self, arg: tuple[int, int]) -> None:
        agent, index = arg
        append, output = self._agents[agent][index]
        context = self._context[agent]
        prompt = context + append
        # Whole blocks of the context; never the last prompt token (the engine computes it for its logits).
        hit = min(context, prompt - 1) // self.hw.block_tokens * self.hw.block_tokens
        self._waiting.append(Turn(agent, index, prompt, hit, output))
        self._place_waiting()

    def _place_waiting(self) -> None:
        """The dispatcher's FIFO: the head is placed first; all wait while the policy says no PE can take it."""
        while self._waiting:
            turn = self._waiting[0]
            t0 = time.perf_counter()
            placement = self.dispatcher.try_place(self._pes, turn.prompt_tokens, turn.hit_tokens, None)
            self._placement_s += time.perf_counter() - t0
            if placement is None:
                return
            self._placements += 1
            self._waiting.popleft()
            turn.placement = placement
            self._read(turn)

    def _read(self, turn: Turn) -> None:
        placement = turn.placement
        now = self.loop.now
        done = now
        pe_node, de_node = self.nodes[placement.prefill.node], self.nodes[placement.decode.node]
        if self.mode != "oracle" and turn.hit_tokens:
            for side, tokens in self._read_parts(turn, pe_node, de_node):
                nbytes = tokens * self.hw.kv_bytes_per_token
                legs = hit_legs(side, pe_node, self.gpus[placement.prefill.name], de_node,
                                self.gpus[placement.decode.name])  # fmt: skip
                for link, times in legs:
                    done = max(done, link.carry(now, times * nbytes))
                self.hit_bytes += nbytes
                self._side_bytes[side] += nbytes
        self._read_sides[placement.read_side] += 1
        self.loop.at(done, self._compute, turn)

    def _read_parts(self, turn: Turn, pe_node: NodeLinks, de_node: NodeLinks) -> list[tuple[str, int]]:
        """(side, hit tokens) read on each side: the connector's plan, the DE taking only what it ends sooner."""
        placement, hit = turn.placement, turn.hit_tokens
        if placement.read_side != "pe" or not placement.decode_may_read:
            return [(placement.read_side, hit)]
        now, rate = self.loop.now, self.hw.storage_bytes_per_s / self.hw.kv_bytes_per_token
        plan = plan_read(
            num_chunks=hit // self.hw.block_tokens, chunk_tokens=self.hw.block_tokens, hit_tokens=hit,
            queued_tokens=round(max(0.0, pe_node.storage.free_at - now) * rate), tokens_per_s=rate,
            max_deadline_s=DE_READ_TIMEOUT_S, split_min_tokens=self.split_read_min_tokens,
        )  # fmt: skip
        offered = hit - plan.head_chunks * self.hw.block_tokens
        if plan.kind == "here" or max(now, de_node.storage.free_at) + offered / rate > now + plan.deadline_s:
            return [("pe", hit)]  # nothing offered, or the DE declines
        if plan.head_chunks == 0:
            placement.read_side = "de"  # the whole read moves
            self._moved_reads += 1
            return [("de", hit)]
        self._split_reads += 1
        return [("pe", hit - offered), ("de", offered)]

    def _save(self, turn: Turn, node: NodeLinks, first_token: int, end_token: int) -> None:
        """``node`` saves the whole blocks of tokens [first_token, end_token) through its storage NIC."""
        blocks = self.hw.block_tokens
        tokens = end_token // blocks * blocks - first_token // blocks * blocks
        if tokens > 0:
            nbytes = tokens * self.hw.kv_bytes_per_token
            self._saved_bytes += nbytes
            turn.stored_at = max(turn.stored_at, node.storage_write.carry(self.loop.now, nbytes))

    def _compute(self, turn: Turn) -> None:
        pe = turn.placement.prefill.name
        if self._stepper is not None:
            self._stepper.submit(pe, turn, turn.prompt_tokens - turn.hit_tokens, turn.hit_tokens)
            return
        start = max(self.loop.now, self._compute_free[pe])
        new = turn.prompt_tokens - turn.hit_tokens
        self._compute_free[pe] = start + self.hw.prefill_s(new, turn.hit_tokens)
        self.loop.at(self._compute_free[pe], self._prefilled, turn)

    def _prefilled(self, turn: Turn) -> None:
        # The PE saves the prompt blocks it computed.
        self._save(turn, self.nodes[turn.placement.prefill.node], turn.hit_tokens, turn.prompt_tokens)
        t0 = time.perf_counter()
        self.dispatcher.finish_prefill(turn.placement, completed=True)
        self._placement_s += time.perf_counter() - t0
        decode_s = self.hw.request_overhead_s + turn.output_tokens * self.hw.tpot_s
        self.loop.at(self.loop.now + decode_s, self._decoded, turn)
        self._place_waiting()

    def _decoded(self, turn: Turn) -> None:
        t0 = time.perf_counter()
        self.dispatcher.finish_decode(turn.placement)
        self._placement_s += time.perf_counter() - t0
        self.turns_done += 1
        self._context[turn.agent] = turn.prompt_tokens + turn.output_tokens
        # The DE saves the blocks decoding completed (the last output token has no KV yet).
        self._save(turn, self.nodes[turn.placement.decode.node], turn.prompt_tokens,
                   turn.prompt_tokens + turn.output_tokens - 1)  # fmt: skip
        if turn.index + 1 < len(self._agents[turn.agent]):
            # The next turn waits until what it will hit is stored (as the bench's replay does).
            self.loop.at(max(self.loop.now, turn.stored_at), self._start_turn, (turn.agent, turn.index + 1))
        else:
            self._agents_done += 1
            self._agent_end_sum += self.loop.now
            self._place_waiting()

    # -- results -----------------------------------------------------------------------------------
    def links(self) -> list[Link]:
        return [link for n in self.nodes.values() for link in (n.storage, n.dram, n.storage_write)] + \
               [link for g in self.gpus.values() for link in (g.read, g.write)]  # fmt: skip

    def _result(self, jct: float, wall_s: float) -> RunResult:
        # Mean over the links of a kind: §4.2's load-balanced load; the max shows the imbalance.
        by_kind: dict[str, list[float]] = {}
        for link in self.links():
            by_kind.setdefault(link.kind, []).append(link.utilisation(jct))
        utilisation = {kind: sum(values) / len(values) for kind, values in by_kind.items()}
        utilisation_max = {kind: max(values) for kind, values in by_kind.items()}
        return RunResult(
            mode=self.mode, prefill_nodes=self.prefill_nodes, decode_nodes=self.decode_nodes, agents=len(self._agents),
            turns=self.turns_done, jct_s=jct, agent_mean_s=self._agent_end_sum / max(1, self._agents_done), hit_bytes=self.hit_bytes, read_sides=dict(self._read_sides),
            link_bytes={link.name: link.bytes for link in self.links()}, utilisation=utilisation,
            utilisation_max=utilisation_max,
            placements=self._placements, placement_s=self._placement_s, events=self.loop.processed, wall_s=wall_s,
            side_bytes=dict(self._side_bytes), moved_reads=self._moved_reads, split_reads=self._split_reads,
            saved_bytes=self._saved_bytes,
            prefill_steps=self._stepper.stats.to_json() if self._stepper is not None else {},
        )  # fmt: skip
