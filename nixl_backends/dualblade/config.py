"""``{"backend": "dualblade", ...}``: one dataclass, validated once, errors naming the key."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from nixl_backends.configuration import ConfigError
from nixl_backends.dualblade.ranker import RANKERS


@dataclass
class DualBladeStoreConfig:
    # Where the chunks live relative to the engine (vLLM KV events' locality): its own NVMe.
    locality: ClassVar[str] = "LOCAL"

    # Directory for the journal and lock, and for the extent file unless ``device`` is set. One writer per
    # root: with several ranks per engine, ``{tp_rank}`` and ``{pp_rank}`` in it give each rank its own.
    root: str
    # The tier's byte budget: the extent file is preallocated to it; chunks past it evict by the ranker.
    capacity_bytes: int = 8 << 30
    # A raw block device (an NVMe partition or namespace) to hold the extents instead of a file; its contents are lost.
    device: str = ""
    # The knob X of Algorithm 1: bytes of each resident chunk's front layers admitted to the page-cache path.
    # None: the measured page-cache budget (Dual-Blade); 0: everything on the direct path. Never above the budget.
    page_cache_bytes: int | None = None
    # Memory the budget leaves alone (the paper's pinned copy buffers, Eq. 2).
    reserve_bytes: int = 0
    # Share of the budget left to other file pages charged to the same cgroup (the engine's own libraries,
    # logs): a page cache filled to the limit makes the kernel reclaim the tier's pages, and every reclaimed
    # page-cache-path layer becomes a slow buffered miss.
    page_cache_headroom: float = 0.1
    # "layers": Algorithm 1, the front n1 layers of every chunk; "ranked": the ranker's hottest chunks whole.
    residency: Literal["layers", "ranked"] = "layers"
    ranker: str = "recency"
    pipeline: Literal["adaptive", "intra", "cross"] = "adaptive"
    # How often the budget is re-read and the residency re-planned (on I/O; no thread).
    replan_interval_s: float = 1.0
    io_engine: Literal["aio", "uring", "posix_aio"] = "aio"
    io_timeout_s: float = 30.0

    def validate(self) -> None:
        if not self.root:
            raise ConfigError("store.root must name a directory")
        try:
            self.root.format(tp_rank=0, pp_rank=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"store.root {self.root!r}: the only placeholders are {{tp_rank}} and {{pp_rank}} "
                              f"({exc})") from None
        if self.capacity_bytes <= 0:
            raise ConfigError(f"store.capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.page_cache_bytes is not None and self.page_cache_bytes < 0:
            raise ConfigError(f"store.page_cache_bytes must be >= 0 or null, got {self.page_cache_bytes}")
        if self.reserve_bytes < 0:
            raise ConfigError(f"store.reserve_bytes must be >= 0, got {self.reserve_bytes}")
        if not 0 <= self.page_cache_headroom < 1:
            raise ConfigError(f"store.page_cache_headroom must be in [0, 1), got {self.page_cache_headroom}")
        if self.ranker not in RANKERS:
            raise ConfigError(f"bad value for store.ranker: {self.ranker!r}; choose one of {sorted(RANKERS)}")
        if self.replan_interval_s < 0:
            raise ConfigError(f"store.replan_interval_s must be >= 0, got {self.replan_interval_s}")
        if self.io_timeout_s <= 0:
            raise ConfigError(f"store.io_timeout_s must be positive, got {self.io_timeout_s}")

    def for_rank(self, tp_rank: int, pp_rank: int) -> DualBladeStoreConfig:
        """The section one engine rank opens (its placeholders filled in)."""
        return replace(self, root=self.root.format(tp_rank=tp_rank, pp_rank=pp_rank))
