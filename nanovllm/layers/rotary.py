"""Rotary position embedding with a precomputed cos/sin table, optionally after per-head norms and
followed by storing the keys and values in the KV cache.

Scaling for long contexts only changes the frequencies, hence the table: the kernel is the same.
"""
import math

import torch
from torch import nn

from nanovllm.kernels.rotary_embedding import KVStore, RotaryInputs, apply_rotary, apply_rotary_ref
from nanovllm.layers.layernorm import RMSNorm

# rope types (the `rope_type` of a config's rope parameters) this layer computes
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's rule: wavelengths shorter than original / high_freq_factor stay, those longer than
    original / low_freq_factor are stretched by `factor`, and the band between blends the two."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


def rotary_inv_freq(head_dim: int, base: float, rope_scaling: dict | None = None) -> torch.Tensor:
    """The rotation frequency of each pair of dimensions; rope_scaling holds `rope_type` and its
    parameters (None or rope_type 'default': plain rotary)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        missing = [key for key in LLAMA3_KEYS if key not in rope_scaling]
        if missing:
            raise ValueError(f"rope_scaling of rope_type 'llama3' lacks {missing}")
        return llama3_inv_freq(inv_freq, *(float(rope_scaling[key]) for key in LLAMA3_KEYS))
    raise ValueError(f"rope_scaling: rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """One table serves every layer of a model (its size is max_position x head_dim floats)."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        inv_freq = rotary_inv_freq(head_dim, base, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None, kv_store: KVStore | None = None):
        """Given q_norm and k_norm, each head is normalised first; given kv_store, the rotated keys
        and the values are then written to the cache. On the GPU all of it is one kernel."""
        rotate = apply_rotary if q.is_cuda else apply_rotary_ref
        inputs = self.inputs(positions, q_norm, k_norm)
        return rotate(positions, q, k, inputs.cos_sin_cache, inputs.norm_weights, inputs.eps, kv_store)

    def inputs(self, positions: torch.Tensor, q_norm: RMSNorm | None = None,
               k_norm: RMSNorm | None = None) -> RotaryInputs:
        """What a kernel needs besides q and k to do this layer's work (see paged_decode_attention)."""
        norm_weights = (q_norm.weight, k_norm.weight) if q_norm is not None else None
        return RotaryInputs(positions, self.cos_sin_cache, norm_weights, q_norm.eps if q_norm else 0.0)
