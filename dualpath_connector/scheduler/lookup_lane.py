"""Store lookups off vLLM's scheduler thread.

``get_num_new_matched_tokens`` runs on the thread that schedules every request;
a store that answers in 5-50 ms per request (a real S3 endpoint) would stall
every running decode for as long. vLLM lets a connector answer ``None`` ("ask
again next step") and keeps scheduling the other requests meanwhile: the lane
answers from remembered answers when they settle the hit, else starts the
store lookup on its own thread and answers ``None`` until it is in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from nixl_backends.lookup import PresentChunks
from nixl_backends.store import KVStore

class LookupLane:
    """One store lookup in flight per request, answered on a later call.

    ``store``: called for the store each time a lookup starts (the scheduler's, which tests may swap).
    ``executor``: where lookups run; one thread by default, so the store sees one lookup at a time (each
    already keeps its own HEADs in flight); an executor that runs the call inline answers at once.
    """

    def __init__(self, present: PresentChunks, store: Callable[[], KVStore], executor: Executor | None = None) -> None:
        self._present = present
        self._store = store
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="dualpath-lookup")
        self._owns_executor = executor is None
        # request id -> (the keys asked about, the lookup's future)
        self._pending: dict[str, tuple[list[str], Future]] = {}

    def answer(self, request_id: str, keys: Sequence[str], background: bool = True) -> int | None:
        """The leading run of ``keys`` present, or None while the store is being asked (ask again).

        ``background`` false: wait for the answer here (an idle engine: vLLM would only spin through empty
        steps, each a round trip to its workers, and on a small machine slow the lookup it waits for).
        A store error is raised once, from the call that collects it: the caller decides what an outage means.
        """
        keys = list(keys)
        pending = self._pending.get(request_id)
        if pending is not None and pending[0] == keys:
            if background and not pending[1].done():
                return None
            del self._pending[request_id]
            return pending[1].result()
        self.drop(request_id)  # a lookup for other keys (the request grew) is of no use
        settled = self._present.settled_run(keys)
        if settled is not None:
            return settled
        if not background:
            return self._present.leading_present(self._store(), keys)
        future = self._executor.submit(self._present.leading_present, self._store(), keys)
        if future.done():
            return future.result()
        self._pending[request_id] = (keys, future)
        return None

    def in_flight(self, request_id: str) -> Future | None:
        """The lookup running for ``request_id``, if any (tests wait on it)."""
        pending = self._pending.get(request_id)
        return pending[1] if pending is not None else None

    def drop(self, request_id: str) -> None:
        """The request finished or changed: its lookup's answer is not wanted (it still fills the cache)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[1].cancel()

    def close(self) -> None:
        for request_id in list(self._pending):
            self.drop(request_id)
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
