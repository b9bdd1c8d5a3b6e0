"""dualpath_mma: the multipath host<->GPU copy library, ``libmma_preload.so``, as an installed package.

``library_path()`` is where this installation's library is; ``mma-run COMMAND [ARGS...]``
(:mod:`dualpath_mma.launcher`) runs a command with it preloaded. The wheel build compiles the
library from ``mma_preload/src`` with ``mma_preload/Makefile`` (setup.py) and puts it next to this
file; in a source checkout (an editable install) it is ``mma_preload/build/libmma_preload.so``,
built by ``make mma``. What the library does and its ``MMA_*`` settings: ``mma_preload/README.md``.

Standard library only, and no import of the rest of dualpath-kv: the checkout's
``mma_preload/mma-run`` runs the launcher with whatever ``python3`` is on PATH.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["LIBRARY_NAME", "LibraryNotFound", "library_path"]

LIBRARY_NAME = "libmma_preload.so"
_PACKAGE_DIR = Path(__file__).resolve().parent
# The installed wheel's copy first, then a source checkout's build (the editable install maps this
# package to the checkout, whose mma_preload/ sits beside it).
_CANDIDATES = (_PACKAGE_DIR / LIBRARY_NAME, _PACKAGE_DIR.parent / "mma_preload" / "build" / LIBRARY_NAME)


class LibraryNotFound(FileNotFoundError):
    """No ``libmma_preload.so`` in this installation; the message says where it looked and how to get one."""


def library_path() -> Path:
    """The absolute path of this installation's ``libmma_preload.so``; :class:`LibraryNotFound` if there is none."""
    for candidate in _CANDIDATES:
        if candidate.is_file():
            return candidate
    raise LibraryNotFound(
        f"{LIBRARY_NAME} not found (looked for {', '.join(map(str, _CANDIDATES))}); in a source checkout build it "
        "with `make mma`, else reinstall dualpath-kv where a C++ compiler and make are available"
    )
