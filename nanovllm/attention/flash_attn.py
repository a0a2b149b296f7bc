"""Optional: flash-attn's varlen and paged calls where the package is installed. Its paged path
needs blocks of a multiple of 256 tokens; other cases stay on the Triton kernels."""
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanovllm.attention.triton import TritonAttention


class FlashAttnAttention(TritonAttention):
    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        if metadata.is_prefill and not metadata.has_cached_context:
            return flash_attn_varlen_func(q, k, v, metadata.cu_seqlens_q, metadata.cu_seqlens_q, metadata.max_seqlen_q,
                                          metadata.max_seqlen_q, softmax_scale=scale, causal=True)
        if metadata.is_prefill or k_cache.shape[1] % 256:
            return super().forward(q, k, v, k_cache, v_cache, metadata, scale)
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.context_lens,
                                       block_table=metadata.block_tables, softmax_scale=scale,
                                       causal=True).squeeze(1)
