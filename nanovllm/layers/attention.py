"""Attention of one layer over the paged KV cache.

Each step first writes the new tokens' keys and values into the cache at their slots (the rotary
kernel does it as it rotates the keys: the model passes it `Attention.kv_store(v)`), then attends
through the backend the model runner chose (nanovllm/attention/). A layer that attends without
having stored its step's keys, or without a backend, raises instead of reading stale memory.
"""
import torch
from torch import nn

from nanovllm.attention import AttentionBackend, current_metadata
from nanovllm.kernels.rotary_embedding import KVStore


class Attention(nn.Module):
    """Multi-head attention of one layer; the model runner attaches the cache and the backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend: AttentionBackend | None = None
        self._stored_for = None            # the step metadata whose K/V this layer last stored

    def kv_store(self, v: torch.Tensor) -> KVStore | None:
        """Where this step's keys and values v go; None during the memory-profiling warm-up, which
        runs before the cache exists."""
        if not self.k_cache.numel():
            return None
        metadata = current_metadata()
        self._stored_for = metadata
        return KVStore(v, self.k_cache, self.v_cache, metadata.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim], k/v: [tokens, kv_heads, head_dim], already in the cache
        (see kv_store) -> [tokens, heads * head_dim]."""
        metadata = current_metadata()
        if self.backend is None:
            raise RuntimeError("attention layer has no backend: the model runner must attach one")
        if self.k_cache.numel() and self._stored_for is not metadata:
            raise RuntimeError("attention layer attends without having stored this step's keys and values: "
                               "the model must pass Attention.kv_store(v) to the rotary embedding")
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale)
        return o.flatten(1, 2)
