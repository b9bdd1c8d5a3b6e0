"""KV cache tensors in every layout vLLM allocates, for the tests and the GPU check script.

Each builder returns one tensor per layer, shaped and strided as the attention
backend hands them to a connector's ``register_kv_caches``:

- older per-layer layouts: FlashAttention ``[2, blocks, block, heads, dim]``
  (K and V apart), the same allocated heads-before-tokens (HND), FlashInfer
  ``[blocks, 2, block, heads, dim]``, vLLM's CPU backend ``[2, blocks, heads, block, dim]``,
  MLA ``[blocks, block, latent]`` (one latent vector per token, no K/V split);
- vLLM 0.32's logical ``[blocks, heads, block, 2*dim]`` (K and V packed in the
  content) in the physical orders its ``KVCacheLayout`` names: ``LBHNC``,
  ``LBNHC``, ``LHBNC`` (heads outside blocks) and the cross-layer ``BLHNC`` /
  ``BLNHC``, where every layer's view slices one allocation whose blocks hold
  all layers' pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_blocks: int
    block: int  # tokens per block
    heads: int
    dim: int
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    latent: int = 576  # MLA: kv_lora_rank + rope dim, as DeepSeek V2/V3


def _per_layer(make: Callable[[CacheShape], torch.Tensor]) -> Callable[[CacheShape], list[torch.Tensor]]:
    return lambda s: [make(s) for _ in range(s.num_layers)]


def _empty(s: CacheShape, *shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=s.dtype, device=s.device)


def _cross_layer(heads_first: bool) -> Callable[[CacheShape], list[torch.Tensor]]:
    def make(s: CacheShape) -> list[torch.Tensor]:
        if heads_first:
            shared = _empty(s, s.num_blocks, s.num_layers, s.heads, s.block, 2 * s.dim)
            return [shared[:, layer] for layer in range(s.num_layers)]
        shared = _empty(s, s.num_blocks, s.num_layers, s.block, s.heads, 2 * s.dim)
        return [shared[:, layer].permute(0, 2, 1, 3) for layer in range(s.num_layers)]

    return make


# name -> (builder, outer: the block's runs of bytes per layer, as KVCacheView finds them)
LAYOUTS: dict[str, tuple[Callable[[CacheShape], list[torch.Tensor]], Callable[[CacheShape], int]]] = {
    "flash_attention": (_per_layer(lambda s: _empty(s, 2, s.num_blocks, s.block, s.heads, s.dim)), lambda s: 2),
    "hnd": (_per_layer(lambda s: _empty(s, 2, s.num_blocks, s.heads, s.block, s.dim).permute(0, 1, 3, 2, 4)),
            lambda s: 2),
    "flash_infer": (_per_layer(lambda s: _empty(s, s.num_blocks, 2, s.block, s.heads, s.dim)), lambda s: 1),
    "cpu": (_per_layer(lambda s: _empty(s, 2, s.num_blocks, s.heads, s.block, s.dim)), lambda s: 2),
    "mla": (_per_layer(lambda s: _empty(s, s.num_blocks, s.block, s.latent)), lambda s: 1),
    "LBHNC": (_per_layer(lambda s: _empty(s, s.num_blocks, s.heads, s.block, 2 * s.dim)), lambda s: 1),
    "LBNHC": (_per_layer(lambda s: _empty(s, s.num_blocks, s.block, s.heads, 2 * s.dim).permute(0, 2, 1, 3)),
              lambda s: 1),
    "LHBNC": (_per_layer(lambda s: _empty(s, s.heads, s.num_blocks, s.block, 2 * s.dim).permute(1, 0, 2, 3)),
              lambda s: s.heads),
    "BLHNC": (_cross_layer(heads_first=True), lambda s: 1),
    "BLNHC": (_cross_layer(heads_first=False), lambda s: 1),
}  # fmt: skip


def make_caches(layout: str, shape: CacheShape, seed: int) -> list[torch.Tensor]:
    """One tensor per layer in ``layout``, every byte random (seeded)."""
    from dualpath_connector.cache.kv_cache_view import physical_block_view

    build, _ = LAYOUTS[layout]
    layers = build(shape)
    device = layers[0].device
    # Drawn where the cache lives: a 32k-token cache on a GPU is 16 GiB, slow to draw on the host.
    generator = torch.Generator(device=device).manual_seed(seed)
    for kv in layers:
        view = physical_block_view(kv, shape.num_blocks)
        view.copy_(torch.randint(0, 256, view.shape, generator=generator, dtype=torch.uint8, device=device))
    return layers
