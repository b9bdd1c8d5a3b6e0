"""Development scaffolding: a real S3 server, the tiny test model, engine/router/gateway processes.

Used by the tests, the demos (``examples/``) and the benchmarks; never installed
(the wheel leaves this package out), so nothing that serves imports it.
"""
