"""Attention of one layer over the paged KV cache.

Each step the layer rotates its queries and keys (after the q/k norms some families have), writes
the new keys and values into the cache at their slots, then attends through the backend the model
runner chose (nanovllm/attention/). The rotary kernel does the rotation and the store in one pass;
a backend may take over all of it for the steps it can do in one kernel (small decode batches on
the GPU: see TritonAttention.rotate_and_attend). A float8 cache comes with its scales (k_scale,
v_scale), attached beside it; 16-bit caches have none.
"""
import torch
from torch import nn

from nanovllm.attention import AttentionBackend, current_metadata
from nanovllm.kernels.rotary_embedding import KVStore
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Multi-head attention of one layer; the model runner attaches the cache and the backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None   # float8 caches only: float32, 1 or num_kv_heads values
        self.v_scale: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary_emb: RotaryEmbedding, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> torch.Tensor:
        """q: [tokens, heads, head_dim], k/v: [tokens, kv_heads, head_dim] as the projection left
        them -> [tokens, heads * head_dim]."""
        metadata = current_metadata()
        if self.backend is None:
            raise RuntimeError("attention layer has no backend: the model runner must attach one")
        # no cache during the memory-profiling warm-up, which runs before it exists
        kv_store = KVStore(v, self.k_cache, self.v_cache, metadata.slot_mapping, self.k_scale, self.v_scale) \
            if self.k_cache.numel() else None
        o = None
        if kv_store is not None:
            o = self.backend.rotate_and_attend(q, k, rotary_emb.inputs(positions, q_norm, k_norm), kv_store,
                                               metadata, self.scale)
        if o is None:
            q, k = rotary_emb(positions, q, k, q_norm, k_norm, kv_store)
            o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale, self.k_scale,
                                     self.v_scale)
        return o.flatten(1, 2)
