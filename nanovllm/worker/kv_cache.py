"""The paged K/V pool of one rank: its dtype and scales, its size, and the per-layer views
attention reads.

One tensor [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim] is allocated once; each
attention layer gets its K and V slices. Sizing is the runner's (it knows the memory left after a
warm-up); this object turns bytes into blocks. A float8 pool (kv_cache_dtype="fp8") stores half the
bytes of a 16-bit one, so the same memory holds twice the tokens; each layer gets a float32 K scale
and V scale (see kernels/fp8_kv_cache.py), which the runner measures at start-up (Worker._calibrate_kv_scales).
"""
import os

import torch

from nanovllm.kernels.fp8_primitives import FP8_DTYPE
from nanovllm.layers.attention import Attention

CPU_KV_CACHE_SHARE = 0.25   # of physical memory, when the CPU pool is sized automatically


class KVCache:
    def __init__(self, layers: list[Attention], block_size: int, dtype: torch.dtype, device: torch.device):
        self.layers = layers
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.num_kv_heads, self.head_dim = layers[0].num_kv_heads, layers[0].head_dim
        self.num_blocks = 0
        self.tensor: torch.Tensor | None = None
        self.is_fp8 = dtype == FP8_DTYPE
        # one K scale and one V scale per layer, float32 on the device (float8 pools only)
        self.scales = torch.ones(2, len(layers), 1, dtype=torch.float32, device=device) if self.is_fp8 else None

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        return 2 * len(self.layers) * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def blocks_for_bytes(self, num_bytes: float) -> int:
        return int(num_bytes // self.block_bytes)

    def allocate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(2, len(self.layers), num_blocks, self.block_size, self.num_kv_heads,
                                  self.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = self.tensor[0, i], self.tensor[1, i]
            if self.is_fp8:
                layer.k_scale, layer.v_scale = self.scales[0, i], self.scales[1, i]

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy whole blocks, every layer's keys and values: pairs [n, 2] of (source, destination)."""
        self.tensor[:, :, pairs[:, 1]] = self.tensor[:, :, pairs[:, 0]]

    def release(self) -> None:
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
            layer.k_scale = layer.v_scale = None
        self.tensor = None


def cpu_budget_bytes(world_size: int) -> float:
    """The share of this machine's memory one CPU rank gives to its pool."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_KV_CACHE_SHARE / world_size
