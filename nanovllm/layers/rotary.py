"""Rotary position embedding with a precomputed cos/sin table, optionally after per-head norms and
followed by storing the keys and values in the KV cache."""
import torch
from torch import nn

from nanovllm.kernels.rotary_embedding import KVStore, apply_rotary, apply_rotary_ref
from nanovllm.layers.layernorm import RMSNorm


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None, kv_store: KVStore | None = None):
        """Given q_norm and k_norm, each head is normalised first; given kv_store, the rotated keys
        and the values are then written to the cache. On the GPU all of it is one kernel."""
        rotate = apply_rotary if q.is_cuda else apply_rotary_ref
        norm_weights = (q_norm.weight, k_norm.weight) if q_norm is not None else None
        return rotate(positions, q, k, self.cos_sin_cache, norm_weights, q_norm.eps if q_norm else 0.0, kv_store)
