"""The scheduler half: store lookups, hit decisions, load and save plans, the PD hand-off; and the compute quota.

Imports :mod:`~dualpath_connector.metrics` and the top-level config, protocol and metadata.
"""
