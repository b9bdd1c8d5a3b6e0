"""The errors ``dualpath-bench`` reports as a usage problem (message, exit code 2), not as a crash.

Here, not in the modules that raise them, so that the command can catch them
without importing the emulated cluster, which needs the checkout's dev scaffolding.
"""


class BenchUsageError(Exception):
    """A setting, file or environment the bench cannot use; the message names it."""
