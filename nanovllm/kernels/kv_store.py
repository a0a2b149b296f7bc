"""Write the new tokens' keys and values into the paged KV cache at their slots.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset.
Slot -1 marks a padding token (CUDA-graph batches) and is skipped.
"""
import torch

from nanovllm.kernels.triton_compat import tl, triton


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid]


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          key_stride, value_stride, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim], heads contiguous within a token."""
    num_tokens, num_heads, head_dim = key.shape
    row = num_heads * head_dim
    assert key.stride(1) == head_dim and key.stride(2) == 1 and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == key.shape[1:]
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row))
