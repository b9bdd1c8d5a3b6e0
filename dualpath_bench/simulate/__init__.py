"""A discrete-event simulator of DualPath clusters that drives the router's own policy code.

``dualpath-bench simulate``: modelled engines, links and agents (dualpath_bench.trace) in simulated
time; placements, read sides and the books are dualpath_router's Dispatcher, Accounting and Policy.
"""
