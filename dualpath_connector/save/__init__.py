"""Saves: a step's completed chunks copied out of the KV cache in that step and written on the save lane.

Imports :mod:`~dualpath_connector.cache`, :mod:`~dualpath_connector.lanes`, :mod:`~dualpath_connector.metrics`
and the top-level protocol and metadata.
"""
