"""The KV cache as blocks, and the copies in and out of it.

Where a KV cache lives for NIXL (this engine's and a peer's), any vLLM layout
viewed as physical blocks, the copy streams ordered against the forward's, and
the GPU path's staged copies. Imports only :mod:`dualpath_connector.protocol`
of the connector (and the storage layer).
"""
