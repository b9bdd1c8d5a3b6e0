"""The replay's client drops idle connections to the router before the router's server closes them.

Both sides expiring at 5 s (httpx's and uvicorn's defaults) lets a turn go out on a connection the router is
closing: it fails with ReadError and is not resent.
"""

from dualpath_bench import replay
from dualpath_router.app import IDLE_KEEP_ALIVE_S


def test_the_replay_drops_idle_connections_before_the_router_closes_them() -> None:
    assert 0 < replay.KEEPALIVE_EXPIRY_S < IDLE_KEEP_ALIVE_S
