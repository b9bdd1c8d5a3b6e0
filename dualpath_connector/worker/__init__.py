"""The worker half: vLLM's worker hooks wiring the load, save and PD rooms, and the timings of this engine's
forwards (recompute time, per-layer compute window).

May import every room but the scheduler; nothing imports it but the facade.
"""
