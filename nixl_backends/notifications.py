"""One reader of a NIXL agent's notifications, handing each to the owner of its prefix.

``nixl_agent.get_new_notifs()`` returns (and forgets) every notification that
arrived for the agent, whoever it is meant for. Two readers of one agent (the
PD side channel's ``pulled:``/``release:`` and the s3agg client's ``s3agg:``)
would each drop the other's, so every part that expects notifications
registers a prefix with the agent's one :class:`NotificationDispatcher`
(:func:`dispatcher_for`) and anyone waiting for one calls :meth:`poll`.
Polling also progresses UCX, which transfers into memory this agent lent out
may need.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from prometheus_client import Counter

logger = logging.getLogger(__name__)

UNROUTED = Counter("nixl_notifications_unrouted_total", "NIXL notifications no registered prefix claimed")

Handler = Callable[[bytes], None]
T = TypeVar("T")


class NotificationDispatcher:
    """Routes an agent's notifications to handlers by prefix; thread-safe."""

    def __init__(self, agent) -> None:
        # Weak: the dispatcher is the value of a weak map keyed by the agent, which must stay collectable.
        self._agent = weakref.ref(agent)
        self._handlers: dict[bytes, Handler] = {}
        self._lock = threading.Lock()
        # One drain at a time, so each message is handled once and in arrival order.
        self._poll_lock = threading.Lock()

    def register(self, prefix: bytes, handler: Handler) -> None:
        """Send every notification starting with ``prefix`` to ``handler`` (called on the polling thread; keep
        it short: no blocking, no NIXL calls)."""
        if not prefix:
            raise ValueError("a notification prefix must not be empty")
        with self._lock:
            for known in self._handlers:
                if known.startswith(prefix) or prefix.startswith(known):
                    raise ValueError(f"notification prefix {prefix!r} overlaps registered {known!r}")
            self._handlers[prefix] = handler

    def unregister(self, prefix: bytes) -> None:
        with self._lock:
            self._handlers.pop(prefix, None)

    def poll(self) -> int:
        """Drain the agent's notifications into their handlers; how many there were."""
        agent = self._agent()
        if agent is None:
            return 0
        with self._poll_lock:
            count = 0
            for messages in agent.get_new_notifs().values():
                for message in messages:
                    count += 1
                    self._dispatch(message)
            return count

    def _dispatch(self, message: bytes) -> None:
        with self._lock:
            handler = next((h for prefix, h in self._handlers.items() if message.startswith(prefix)), None)
        if handler is None:
            UNROUTED.inc()
            logger.warning("NIXL notification for no registered owner dropped: %r", message[:64])
            return
        try:
            handler(message)
        except Exception:
            # One bad message (a peer's, possibly hostile) must not stop the others being delivered.
            logger.exception("handling NIXL notification %r failed", message[:64])


class PerAgent(Generic[T]):
    """One ``make(agent)`` per NIXL agent, made on first use and dropped with the agent (held weakly)."""

    def __init__(self, make: Callable[[Any], T]) -> None:
        self._make = make
        self._objects: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, agent) -> T:
        with self._lock:
            made = self._objects.get(agent)
            if made is None:
                made = self._objects[agent] = self._make(agent)
            return made


# The agent's one dispatcher.
dispatcher_for: PerAgent[NotificationDispatcher] = PerAgent(NotificationDispatcher)
