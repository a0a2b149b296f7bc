"""Attention over the paged KV cache, and the choice of the backend that computes it.

The layer hands the backend q, k and v straight from the projection, with the rotation that
prepares q and k (Qwen3's per-head norms, then rotary). The backend rotates, writes the new keys and
values into the cache at their slots and attends; where it can, one kernel does several of these.
A backend answers three cases: a plain prefill (no key comes from an earlier step), a prefill whose
keys include cached blocks (prefix-cache hits, later chunks of a long prompt), and decode (one
query per sequence).
"""
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.paged_attention import (paged_attention_ref, paged_decode_attention, paged_decode_attention_ref,
                                              paged_prefill_attention)
from nanovllm.kernels.rotary_embedding import KVStore, Rotary, apply_rotary, apply_rotary_ref
from nanovllm.utils.context import AttentionContext, get_context

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_PARAMS = inspect.signature(varlen_attn).parameters
except ImportError:   # torch < 2.10
    varlen_attn, _VARLEN_PARAMS = None, {}


class AttentionBackend:
    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary,
                k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext, scale: float) -> torch.Tensor:
        raise NotImplementedError


def rotate_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: Rotary,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext):
    """Rotated q and k; the rotated keys and v written to their cache slots, except during the
    memory-profiling warm-up, which runs before the cache exists."""
    kv_store = KVStore(v, k_cache, v_cache, ctx.slot_mapping) if k_cache.numel() else None
    rotate = apply_rotary if q.is_cuda else apply_rotary_ref
    return rotate(positions, q, k, *rotary, kv_store)


class TorchAttention(AttentionBackend):
    """The CPU path: torch reference twins of the kernels over the same paged cache."""

    def forward(self, positions, q, k, v, rotary, k_cache, v_cache, ctx, scale):
        if not ctx.is_prefill:
            return paged_decode_attention_ref(positions, q, k, rotary, KVStore(v, k_cache, v_cache, ctx.slot_mapping),
                                              ctx.context_lens, ctx.block_tables, scale)
        q, k = rotate_and_store(positions, q, k, v, rotary, k_cache, v_cache, ctx)
        return paged_attention_ref(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, scale)


class TritonAttention(AttentionBackend):
    """The GPU default: Triton paged kernels, PyTorch's fused attention for what is not cached."""

    def forward(self, positions, q, k, v, rotary, k_cache, v_cache, ctx, scale):
        if not ctx.is_prefill:
            return paged_decode_attention(positions, q, k, rotary, KVStore(v, k_cache, v_cache, ctx.slot_mapping),
                                          ctx.context_lens, ctx.block_tables, scale, ctx.num_splits)
        q, k = rotate_and_store(positions, q, k, v, rotary, k_cache, v_cache, ctx)
        out = causal_varlen_attention(q, k, v, ctx.cu_seqlens_q, ctx.max_seqlen_q, scale)
        if ctx.has_cached_context:   # redo, over the cache, only the sequences whose keys include cached ones
            paged_prefill_attention(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.max_seqlen_q, ctx.context_lens,
                                    ctx.block_tables, scale, out=out)
        return out


class FlashAttnAttention(TritonAttention):
    """Optional: flash-attn's varlen and paged calls where the package is installed.
    Its paged path needs blocks of a multiple of 256 tokens; other cases stay on Triton."""

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def forward(self, positions, q, k, v, rotary, k_cache, v_cache, ctx, scale):
        if ctx.has_cached_context or (not ctx.is_prefill and k_cache.shape[1] % 256):
            return super().forward(positions, q, k, v, rotary, k_cache, v_cache, ctx, scale)
        q, k = rotate_and_store(positions, q, k, v, rotary, k_cache, v_cache, ctx)
        if ctx.is_prefill:
            return self.varlen(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_q, ctx.max_seqlen_q, ctx.max_seqlen_q,
                               softmax_scale=scale, causal=True)
        return self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=ctx.context_lens,
                                 block_table=ctx.block_tables, softmax_scale=scale, causal=True).squeeze(1)


def causal_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention of packed sequences over their own tokens only."""
    if varlen_attn is not None and q.dtype in (torch.float16, torch.bfloat16):
        kwargs = {}
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if "scale" in _VARLEN_PARAMS:
            kwargs["scale"] = scale
        if "is_causal" in _VARLEN_PARAMS:
            kwargs["is_causal"] = True
        else:
            kwargs["window_size"] = (-1, 0)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                                           v[start:end].transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def choose_attention_backend(device: torch.device) -> AttentionBackend:
    """The one place that decides how attention is computed."""
    if device.type != "cuda":
        return TorchAttention()
    try:
        return FlashAttnAttention()
    except ImportError:
        return TritonAttention()


class Attention(nn.Module):
    """Multi-head attention of one layer; the model runner attaches the cache and the backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.empty(0)
        self.backend: AttentionBackend = TorchAttention()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary: Rotary) -> torch.Tensor:
        """q: [tokens, heads, head_dim], k/v: [tokens, kv_heads, head_dim] from the projection,
        before rotary -> [tokens, heads * head_dim]."""
        o = self.backend.forward(positions, q, k, v, rotary, self.k_cache, self.v_cache, get_context(), self.scale)
        return o.flatten(1, 2)
