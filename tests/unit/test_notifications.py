"""NotificationDispatcher: one reader of an agent's NIXL notifications, each handed to its prefix's owner.

A fake agent stands in for ``nixl_agent``: ``get_new_notifs()`` returns every
queued notification by peer and forgets them, as NIXL's does. Two real agents
over UCX are in ``tests/integration/test_notifications.py``.
"""

from __future__ import annotations

import gc
import weakref

import pytest
from prometheus_client import REGISTRY

from nixl_backends.notifications import NotificationDispatcher, dispatcher_for


class FakeAgent:
    def __init__(self) -> None:
        self.queued: dict[str, list[bytes]] = {}
        self.drains = 0

    def send(self, peer: str, *messages: bytes) -> None:
        self.queued.setdefault(peer, []).extend(messages)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self.drains += 1
        queued, self.queued = self.queued, {}
        return queued


def _unrouted() -> float:
    return REGISTRY.get_sample_value("nixl_notifications_unrouted_total") or 0.0


@pytest.fixture
def agent() -> FakeAgent:
    return FakeAgent()


def test_each_prefix_gets_its_own_messages_in_arrival_order(agent):
    dispatcher = NotificationDispatcher(agent)
    pulled, s3agg = [], []
    dispatcher.register(b"pulled:", pulled.append)
    dispatcher.register(b"s3agg:", s3agg.append)
    agent.send("de", b"pulled:r1", b"s3agg:q:0", b"pulled:r2")
    agent.send("gateway", b"s3agg:q:1", b"s3agg:q:2")
    assert dispatcher.poll() == 5
    assert pulled == [b"pulled:r1", b"pulled:r2"]
    assert s3agg == [b"s3agg:q:0", b"s3agg:q:1", b"s3agg:q:2"]
    # Drained: a second poll finds nothing and hands nothing twice.
    assert dispatcher.poll() == 0 and len(pulled) == 2 and len(s3agg) == 3


@pytest.mark.parametrize("second", [b"pulled:", b"pull", b"pulled:x"], ids=["same", "shorter", "longer"])
def test_an_overlapping_prefix_is_refused(agent, second):
    dispatcher = NotificationDispatcher(agent)
    dispatcher.register(b"pulled:", lambda m: None)
    with pytest.raises(ValueError, match="overlaps"):
        dispatcher.register(second, lambda m: None)
    # Negative control: a prefix that shares no start with it is fine.
    dispatcher.register(b"release:", lambda m: None)


def test_an_empty_prefix_is_refused(agent):
    with pytest.raises(ValueError, match="empty"):
        NotificationDispatcher(agent).register(b"", lambda m: None)


def test_an_unrouted_message_is_counted_and_dropped(agent):
    dispatcher = NotificationDispatcher(agent)
    got = []
    dispatcher.register(b"pulled:", got.append)
    before = _unrouted()
    agent.send("someone", b"hello", b"pulled:r1", b"pulle")
    assert dispatcher.poll() == 3
    assert got == [b"pulled:r1"]
    assert _unrouted() == before + 2


def test_a_raising_handler_does_not_stop_the_others(agent):
    dispatcher = NotificationDispatcher(agent)
    got = []

    def hostile(message: bytes) -> None:
        raise ValueError(f"bad message {message!r}")

    dispatcher.register(b"release:", hostile)
    dispatcher.register(b"pulled:", got.append)
    agent.send("de", b"release:x", b"pulled:r1", b"release:y", b"pulled:r2")
    assert dispatcher.poll() == 4
    assert got == [b"pulled:r1", b"pulled:r2"]


def test_unregister_sends_later_messages_nowhere(agent):
    dispatcher = NotificationDispatcher(agent)
    got = []
    dispatcher.register(b"pulled:", got.append)
    dispatcher.unregister(b"pulled:")
    dispatcher.unregister(b"never-registered:")  # absent is fine
    before = _unrouted()
    agent.send("de", b"pulled:r1")
    dispatcher.poll()
    assert got == [] and _unrouted() == before + 1
    # The prefix is free again (a PeerLink closed, another opened on the same agent).
    dispatcher.register(b"pulled:", got.append)
    agent.send("de", b"pulled:r2")
    dispatcher.poll()
    assert got == [b"pulled:r2"]


def test_one_dispatcher_per_agent():
    first, second = FakeAgent(), FakeAgent()
    assert dispatcher_for(first) is dispatcher_for(first)
    assert dispatcher_for(first) is not dispatcher_for(second)
    # Two owners of one agent registering with dispatcher_for share its one drain.
    got_pulled, got_s3agg = [], []
    dispatcher_for(first).register(b"pulled:", got_pulled.append)
    dispatcher_for(first).register(b"s3agg:", got_s3agg.append)
    first.send("peer", b"s3agg:q:0", b"pulled:r1")
    dispatcher_for(first).poll()
    assert got_pulled == [b"pulled:r1"] and got_s3agg == [b"s3agg:q:0"] and first.drains == 1


def test_a_dispatcher_does_not_keep_its_agent_alive():
    # dispatcher_for holds agents weakly so that agents of closed engines can go; the dispatcher's own
    # reference to its agent must not defeat that.
    agent = FakeAgent()
    dispatcher_for(agent).register(b"pulled:", lambda m: None)
    gone = weakref.ref(agent)
    del agent
    gc.collect()
    assert gone() is None
