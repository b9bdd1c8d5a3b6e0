"""``dualpath-router``: OpenAI-compatible router for a DualPath prefill/decode cluster (see README.md)."""
