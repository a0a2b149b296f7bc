"""The CPU path: the kernels' torch twins over the same paged cache."""
import torch

from nanovllm.attention.base import AttentionBackend
from nanovllm.kernels.paged_attention import paged_attention_ref


class TorchAttention(AttentionBackend):
    def forward(self, q, k, v, k_cache, v_cache, metadata, scale):
        cu_seqlens_q = metadata.cu_seqlens_q if metadata.is_prefill else torch.arange(q.shape[0] + 1)
        return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, metadata.context_lens, metadata.block_tables,
                                   scale)
