"""Rotary position embedding with a precomputed cos/sin table. The attention backend applies it
(with Qwen3's per-head norms) in the same kernel that stores the keys, or that attends in decode."""
import torch
from torch import nn

from nanovllm.kernels.rotary_embedding import Rotary
from nanovllm.layers.layernorm import RMSNorm


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def with_norms(self, q_norm: RMSNorm, k_norm: RMSNorm) -> Rotary:
        """The rotation, each head normalised first by q_norm or k_norm."""
        return Rotary(self.cos_sin_cache, (q_norm.weight, k_norm.weight), q_norm.eps)
