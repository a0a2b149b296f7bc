"""Attention backends: one small interface (base.py), the torch reference for the CPU, Triton paged
kernels for CUDA, and flash-attn where that package is installed."""
import torch

from nanovllm.attention.base import AttentionBackend, AttentionMetadata, current_metadata, use_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "choose_attention_backend", "current_metadata", "use_metadata"]


def choose_attention_backend(device: torch.device, num_kv_heads: int) -> AttentionBackend:
    """The one place that decides how attention is computed."""
    if device.type != "cuda":
        from nanovllm.attention.torch_reference import TorchAttention
        return TorchAttention()
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    try:
        from nanovllm.attention.flash_attn import FlashAttnAttention
        return FlashAttnAttention(num_sms, num_kv_heads)
    except ImportError:
        from nanovllm.attention.triton import TritonAttention
        return TritonAttention(num_sms, num_kv_heads)
