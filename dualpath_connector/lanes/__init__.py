"""The connector's threads: one I/O lane per link, and the cores its threads run on.

Imports nothing else of the connector.
"""
