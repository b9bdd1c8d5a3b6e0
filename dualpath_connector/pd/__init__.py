"""Prefill/decode between engines: the side channel, the cluster key, the peer link (holds, leases), pulls, and
the engine's HTTP guard.

Imports :mod:`~dualpath_connector.cache`, :mod:`~dualpath_connector.lanes`, :mod:`~dualpath_connector.metrics`
and the top-level protocol and metadata; never the load, save, scheduler or worker rooms.
"""
