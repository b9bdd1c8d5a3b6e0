"""``mma-run COMMAND [ARGS...]``: run a command with ``libmma_preload.so`` preloaded, e.g. ``mma-run vllm serve MODEL``.

The library goes first in ``LD_PRELOAD`` (an existing value is kept after it), then the command
replaces this process (``exec``: same PID, signals and exit status go straight to it).
``MMA_PRELOAD_LIB`` names another library to preload. Exit status when nothing ran: 2 without a
command, 127 when the library or the command is missing, 126 when the command cannot be executed.
The library's own settings are environment variables too (``MMA_*``, mma_preload/README.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from dualpath_mma import LibraryNotFound, library_path

LIBRARY_ENV = "MMA_PRELOAD_LIB"
USAGE = f"""usage: mma-run COMMAND [ARGS...]
Run COMMAND with libmma_preload.so preloaded (multipath host<->GPU copies), e.g. mma-run vllm serve MODEL.
{LIBRARY_ENV}=PATH preloads another build; MMA_* variables configure the library."""


def preload_library(environ: Mapping[str, str]) -> str:
    """The library to preload: ``$MMA_PRELOAD_LIB`` if set, else this installation's; LibraryNotFound if absent."""
    override = environ.get(LIBRARY_ENV)
    if override:
        if not os.path.isfile(override):
            raise LibraryNotFound(f"{LIBRARY_ENV}={override}: no such file")
        return override
    return str(library_path())


def preloaded_environment(library: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``library`` first in ``LD_PRELOAD``; what was there stays after it, listed once."""
    kept = [entry for entry in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if entry and entry != library]
    return {**environ, "LD_PRELOAD": ":".join([library, *kept])}


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command or command[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not command else sys.stdout)
        return 0 if command else 2
    try:
        library = preload_library(os.environ)
    except LibraryNotFound as exc:
        print(f"mma-run: {exc}", file=sys.stderr)
        return 127
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, preloaded_environment(library, os.environ))
    except FileNotFoundError:
        print(f"mma-run: {command[0]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:  # not executable, a directory, a bad interpreter line
        print(f"mma-run: {command[0]}: {exc.strerror}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main())
