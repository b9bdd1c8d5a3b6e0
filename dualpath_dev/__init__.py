"""Development scaffolding: a real S3 server, the tiny test model, engine/router/gateway processes, and the
store as users have it: an S3 relay that adds round trips, throttling and resets, or accepts only credentials
that rotate (``s3_relay.py``, ``credentials_endpoint.py``).

Used by the tests, the demos (``examples/``) and the benchmarks; never installed
(the wheel leaves this package out), so nothing that serves imports it.
"""
