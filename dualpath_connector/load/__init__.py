"""A load, in order: plan (where a hit is read), fetch (here, through the DE, for a PE), verify, inject.

Also the pieces a fetch uses: layer arrivals, the store-read queue, the read timeline, and the stall metric of
layerwise loads. Imports :mod:`~dualpath_connector.cache`, :mod:`~dualpath_connector.lanes`,
:mod:`~dualpath_connector.metrics`, :mod:`~dualpath_connector.pd` and the top-level protocol and metadata.
"""
