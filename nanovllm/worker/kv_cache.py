"""The paged K/V pool of one rank: its dtype, its size, and the per-layer views attention reads.

One tensor [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim] is allocated once; each
attention layer gets its K and V slices. Sizing is the runner's (it knows the memory left after a
warm-up); this object turns bytes into blocks.
"""
import os

import torch

from nanovllm.layers.attention import Attention

CPU_KV_CACHE_SHARE = 0.25   # of physical memory, when the CPU pool is sized automatically


class KVCache:
    def __init__(self, layers: list[Attention], block_size: int, dtype: torch.dtype, device: torch.device):
        self.layers = layers
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.num_kv_heads, self.head_dim = layers[0].num_kv_heads, layers[0].head_dim
        self.num_blocks = 0
        self.tensor: torch.Tensor | None = None

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

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy whole blocks, every layer's keys and values: pairs [n, 2] of (source, destination)."""
        self.tensor[:, :, pairs[:, 1]] = self.tensor[:, :, pairs[:, 0]]

    def release(self) -> None:
        for layer in self.layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.tensor = None


def cpu_budget_bytes(world_size: int) -> float:
    """The share of this machine's memory one CPU rank gives to its pool."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_KV_CACHE_SHARE / world_size
