"""Rotary position embedding with a precomputed cos/sin table."""
import torch
from torch import nn

from nanovllm.kernels.rotary_embedding import apply_rotary, apply_rotary_ref


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        rotate = apply_rotary if q.is_cuda else apply_rotary_ref
        return rotate(positions, q, k, self.cos_sin_cache)
