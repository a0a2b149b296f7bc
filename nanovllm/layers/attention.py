"""Attention over the paged KV cache, and the choice of the backend that computes it.

Each step first writes the new tokens' keys and values into the cache at their slots (the rotary
kernel does it as it rotates the keys: the model passes it `Attention.kv_store(v)`), then attends.
A backend answers three cases: a plain prefill (no key comes from an earlier step), a
prefill whose keys include cached blocks (prefix-cache hits, later chunks of a long prompt), and
decode (one query per sequence). A float8 cache comes with its scales (k_scale, v_scale), which the
model runner attaches beside the cache; 16-bit caches have none.
"""
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.paged_attention import paged_attention_ref, paged_decode_attention, paged_prefill_attention
from nanovllm.kernels.rotary_embedding import KVStore
from nanovllm.utils.context import AttentionContext, get_context

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_PARAMS = inspect.signature(varlen_attn).parameters
except ImportError:   # torch < 2.10
    varlen_attn, _VARLEN_PARAMS = None, {}


class AttentionBackend:
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, ctx: AttentionContext, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    """The CPU path: torch reference twins of the kernels over the same paged cache."""

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, k_scale=None, v_scale=None):
        cu_seqlens_q = ctx.cu_seqlens_q if ctx.is_prefill else torch.arange(q.shape[0] + 1)
        return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, ctx.context_lens, ctx.block_tables, scale,
                                   k_scale, v_scale)


class TritonAttention(AttentionBackend):
    """The GPU default: Triton paged kernels, PyTorch's fused attention for plain prefills."""

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, k_scale=None, v_scale=None):
        if not ctx.is_prefill:
            return paged_decode_attention(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables,
                                          scale, ctx.num_splits, k_scale=k_scale, v_scale=v_scale)
        if ctx.has_cached_context:
            return paged_prefill_attention(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.max_seqlen_q,
                                           ctx.context_lens, ctx.block_tables, scale, k_scale=k_scale,
                                           v_scale=v_scale)
        return causal_varlen_attention(q, k, v, ctx.cu_seqlens_q, ctx.max_seqlen_q, scale)


class FlashAttnAttention(TritonAttention):
    """Optional: flash-attn's varlen and paged calls where the package is installed.
    Its paged path needs blocks of a multiple of 256 tokens and a 16-bit cache; other cases stay on Triton."""

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, k_scale=None, v_scale=None):
        if ctx.is_prefill and not ctx.has_cached_context:
            return self.varlen(q, k, v, ctx.cu_seqlens_q, ctx.cu_seqlens_q, ctx.max_seqlen_q, ctx.max_seqlen_q,
                               softmax_scale=scale, causal=True)
        if ctx.is_prefill or k_cache.shape[1] % 256 or k_cache.element_size() == 1:
            return super().forward(q, k, v, k_cache, v_cache, ctx, scale, k_scale, v_scale)
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
        self.k_scale: torch.Tensor | None = None   # float8 caches only: float32, 1 or num_kv_heads values
        self.v_scale: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchAttention()

    def kv_store(self, v: torch.Tensor) -> KVStore | None:
        """Where this step's keys and values v go; None during the memory-profiling warm-up, which
        runs before the cache exists."""
        if not self.k_cache.numel():
            return None
        return KVStore(v, self.k_cache, self.v_cache, get_context().slot_mapping, self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [tokens, heads, head_dim], k/v: [tokens, kv_heads, head_dim], already in the cache
        (see kv_store) -> [tokens, heads * head_dim]."""
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, get_context(), self.scale,
                                 self.k_scale, self.v_scale)
        return o.flatten(1, 2)
