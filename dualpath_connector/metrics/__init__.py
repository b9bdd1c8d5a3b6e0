"""What the connector reports: the data path's stats, vLLM's stats and ``/metrics``, and the store's KV events.

Imports only the top-level modules (protocol, metadata; config from inside a method).
"""
