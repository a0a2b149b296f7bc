"""The GPU default: Triton paged kernels, PyTorch's fused attention for plain prefills."""
import dataclasses

import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode_attention, paged_prefill_attention

# Decode batches of at most this many sequences rotate inside the decode attention kernel (one
# kernel a layer fewer; its programs each redo their heads' norm and rotation, which larger batches
# pay for: measured slower from 64 sequences on 2026-11-23, docs/benchmarks.md). A float8 cache
# too: its rotating kernel keeps to the register cap without spilling and, on one H100, took
# 6.0-27.6 us a layer against 8.7-27.9 for the rotary kernel then attention (batch 1-16).
ROTARY_IN_DECODE_MAX_SEQS = 16


@dataclasses.dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    num_splits: int = 1               # decode: context splits per sequence (see paged_decode_attention)
    seq_order: torch.Tensor | None = None   # decode: the order programs take the sequences in


class TritonAttention(AttentionBackend):
    def __init__(self, num_sms: int, num_kv_heads: int, cache_dtype: torch.dtype):
        self.num_sms, self.num_kv_heads, self.cache_dtype = num_sms, num_kv_heads, cache_dtype

    def metadata(self, is_prefill, slot_mapping, context_lens, block_tables, cu_seqlens_q, host_context_lens,
                 host_cu_seqlens_q) -> TritonMetadata:
        common = super().metadata(is_prefill, slot_mapping, context_lens, block_tables, cu_seqlens_q,
                                  host_context_lens, host_cu_seqlens_q)
        return TritonMetadata(*_fields(common), num_splits=self._num_splits(len(host_context_lens)))

    def decode_metadata(self, slot_mapping, context_lens, block_tables, seq_order=None) -> TritonMetadata:
        return TritonMetadata(False, slot_mapping, context_lens, block_tables,
                              num_splits=self._num_splits(len(context_lens)), seq_order=seq_order)

    def _num_splits(self, num_seqs: int) -> int:
        return decode_num_splits(num_seqs, self.num_kv_heads, self.num_sms, self.cache_dtype)

    def rotate_and_attend(self, q, k, rotary, kv_store, metadata, scale):
        if metadata.is_prefill or q.shape[0] > ROTARY_IN_DECODE_MAX_SEQS:
            return None
        return paged_decode_attention(q, kv_store.k_cache, kv_store.v_cache, metadata.context_lens,
                                      metadata.block_tables, scale, metadata.num_splits, k_scale=kv_store.k_scale,
                                      v_scale=kv_store.v_scale, rotary=rotary,
                                      new_kv=(k, kv_store.value, kv_store.slot_mapping), seq_order=metadata.seq_order)

    def forward(self, q, k, v, k_cache, v_cache, metadata, scale, k_scale=None, v_scale=None):
        if not metadata.is_prefill:
            return paged_decode_attention(q, k_cache, v_cache, metadata.context_lens, metadata.block_tables,
                                          scale, metadata.num_splits, k_scale=k_scale, v_scale=v_scale,
                                          seq_order=metadata.seq_order)
        if metadata.has_cached_context:
            return paged_prefill_attention(q, k_cache, v_cache, metadata.cu_seqlens_q, metadata.max_seqlen_q,
                                           metadata.context_lens, metadata.block_tables, scale, k_scale=k_scale,
                                           v_scale=v_scale)
        return causal_varlen_attention(q, k, v, metadata.cu_seqlens_q, metadata.max_seqlen_q, scale)


def _fields(metadata: AttentionMetadata) -> tuple:
    return tuple(getattr(metadata, f.name) for f in dataclasses.fields(AttentionMetadata))


def causal_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention of packed sequences over their own tokens only. 16-bit CUDA tensors go to the
    flash kernel behind torch's varlen_attn, called as varlen_attn calls it: that kernel shares each
    K/V head with its group of query heads as they lie, where varlen_attn before `enable_gqa` (torch
    2.11 has none) needed them copied out per query head (two copies of 206 us a layer in a 16k-token
    prefill of the 8B shape on an H200)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                       0.0, True, False, scale=scale)[0]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
                                           v[start:end].transpose(0, 1), is_causal=True, scale=scale,
                                           enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out
