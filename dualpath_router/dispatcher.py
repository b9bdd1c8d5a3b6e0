"""Applies the policy to live accounting: places requests, queues those no PE can take, keeps the books.

Everything here runs on the event loop; a placement and its accounting
happen without an ``await`` in between, so no two requests see the same
state. Requests that find every PE overloaded wait in FIFO order and are
re-examined whenever the accounting changes (a request starts or finishes,
a scrape lands), never by polling.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from dualpath_router.accounting import Accounting, EngineLoad, Role, parse_engine_metrics
from dualpath_router.config import RouterConfig
from dualpath_router.lookup import HitLookup
from dualpath_router.policies import Policy, ReadSide

logger = logging.getLogger(__name__)


class QueueTimeout(Exception):
    """No PE came under beta within ``scheduling.queue_timeout_s``."""


class QueueFull(Exception):
    """``scheduling.max_queued_requests`` requests already wait for a PE."""


@dataclass
class Placement:
    """One request's engines, read side and the amounts booked for it."""

    prefill: EngineLoad
    decode: EngineLoad
    read_side: ReadSide
    prompt_tokens: int
    hit_tokens: int
    # The DE may read for the PE: it is named to the PE even with read side "pe", so the PE can move a
    # read there while its own link is busy. Basic (and a forced "pe") keep every read on the PE.
    decode_may_read: bool = True

    @property
    def read_node(self) -> str:
        return self.prefill.node if self.read_side == "pe" else self.decode.node


class Dispatcher:
    def __init__(self, config: RouterConfig, accounting: Accounting, policy: Policy, lookup: HitLookup) -> None:
        self.config = config
        self.accounting = accounting
        self.policy = policy
        self.lookup = lookup
        # Requests waiting for a PE, in arrival order, each with its own wake-up: only the head can be
        # placed, so a change wakes the head alone, and a request leaving the line costs O(1).
        self._waiting: OrderedDict[object, asyncio.Event] = OrderedDict()

    @property
    def queued_requests(self) -> int:
        return len(self._waiting)

    def _notify_changed(self) -> None:
        if self._waiting:
            next(iter(self._waiting.values())).set()

    def _candidates(self, role: Role, excluded: set[str]) -> list[EngineLoad]:
        everyone = self.accounting.role(role)
        if not excluded and self.accounting.all_healthy(role):
            return everyone  # the role's own list: policies choose from per-node totals (O(nodes))
        engines = [e for e in everyone if e.name not in excluded]
        # A failed scrape may be transient; an engine is only ruled out for a
        # request once a dispatch to it failed.
        return [e for e in engines if e.healthy] or engines

    async def start_prefill(
        self, prompt_tokens: int, hit_tokens: int, excluded_pes: set[str], decode: EngineLoad | None
    ) -> Placement | None:
        """Place a request on a PE (waiting while all are overloaded) and book it.

        ``decode`` keeps the DE of an earlier attempt; otherwise one is chosen
        and booked too. ``None``: every PE already failed this request.
        Raises :class:`QueueTimeout`.
        """
        if len(self._waiting) >= self.config.scheduling.max_queued_requests:
            raise QueueFull
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.scheduling.queue_timeout_s
        ticket, wake = object(), asyncio.Event()
        self._waiting[ticket] = wake
        try:
            while True:
                pes = self._candidates("prefill", excluded_pes)
                if not pes:
                    return None
                if next(iter(self._waiting)) is ticket:
                    placement = self.try_place(pes, prompt_tokens, hit_tokens, decode)
                    if placement is not None:
                        return placement
                wake.clear()  # no await since the check: no change can slip between
                try:
                    await asyncio.wait_for(wake.wait(), deadline - loop.time())
                except TimeoutError:
                    raise QueueTimeout from None
        finally:
            del self._waiting[ticket]
            # The next request in line may now be placeable.
            self._notify_changed()

    def try_place(
        self, pes: list[EngineLoad], prompt_tokens: int, hit_tokens: int, decode: EngineLoad | None
    ) -> Placement | None:
        """One placement attempt among ``pes``, booked; ``None`` when the policy finds every PE overloaded.

        Synchronous, so a caller with its own clock and queue (the simulator,
        dualpath_bench.simulate) drives the same policy and books.
        """
        prefill = self.policy.choose_prefill(pes, self.accounting, prompt_tokens)
        return None if prefill is None else self._book(prefill, decode, prompt_tokens, hit_tokens)

    def _book(self, prefill: EngineLoad, decode: EngineLoad | None, prompt_tokens: int, hit_tokens: int) -> Placement:
        if decode is None:
            decode = self.policy.choose_decode(self._candidates("decode", set()), self.accounting, prompt_tokens)
            self.accounting.decode_started(decode, prompt_tokens)
        forced = self.config.read_side
        read_side = forced if forced != "auto" else self.policy.choose_read_side(prefill, decode, self.accounting)
        decode_may_read = read_side == "de" or (self.policy.decode_side_reads and forced == "auto")
        placement = Placement(prefill, decode, read_side, prompt_tokens, hit_tokens, decode_may_read)
        self.accounting.prefill_started(prefill, prompt_tokens, placement.read_node, hit_tokens)
        return placement

    def finish_prefill(self, placement: Placement, *, completed: bool, engine_failed: bool = False) -> None:
        """``completed``: the PE answered 2xx; ``engine_failed``: it failed before answering."""
        if engine_failed:
            placement.prefill.healthy = False
        self.accounting.prefill_finished(
            placement.prefill, placement.prompt_tokens, placement.read_node, placement.hit_tokens, completed=completed
        )
        self._notify_changed()

    def replace_decode(self, placement: Placement, excluded_des: set[str]) -> bool:
        """After the DE failed: book the request on another DE; ``False`` when none is left."""
        placement.decode.healthy = False
        self.finish_decode(placement)
        des = self._candidates("decode", excluded_des)
        if not des:
            return False
        placement.decode = self.policy.choose_decode(des, self.accounting, placement.prompt_tokens)
        self.accounting.decode_started(placement.decode, placement.prompt_tokens)
        return True

    def finish_decode(self, placement: Placement) -> None:
        self.accounting.decode_finished(placement.decode, placement.prompt_tokens)
        self._notify_changed()

    async def refresh_forever(self, client: httpx.AsyncClient) -> None:
        """Scrape every engine's /metrics each interval; the first scrape runs at once."""
        while True:
            try:
                await self.refresh(client)
            except Exception:  # a bad scrape must not end refreshing for good
                logger.exception("engine metrics refresh failed")
            await asyncio.sleep(self.config.metrics_refresh_interval_s)

    async def refresh(self, client: httpx.AsyncClient) -> None:
        engines = list(self.accounting.engines.values())
        reports = await asyncio.gather(*(self._scrape(client, e) for e in engines))
        for engine, report in zip(engines, reports):
            self.accounting.apply_report(engine, report)
        if self.lookup.namespace is None:
            # namespace: auto; the first engine in config order that exports one.
            found = next((r.namespace for r in reports if r is not None and r.namespace is not None), None)
            if found is not None:
                logger.info("store namespace %s (key prefix %r, %d tokens/chunk) from engine metrics",
                            found.digest, found.key_prefix, found.chunk_tokens)
                self.lookup.namespace = found
        self._notify_changed()

    async def _scrape(self, client: httpx.AsyncClient, engine: EngineLoad):
        try:
            response = await client.get(f"{engine.config.url}/metrics", timeout=self.config.timeouts.metrics_s)
            response.raise_for_status()
            return parse_engine_metrics(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            if engine.healthy:
                logger.warning("engine %s: /metrics failed, marked unhealthy: %s", engine.name, exc)
            return None
