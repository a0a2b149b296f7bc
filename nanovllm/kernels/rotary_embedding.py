"""Rotary position embedding (the rotate-half form Qwen3 uses), applied to queries and keys.

cos_sin_cache: [max_position, head_dim] float32, cosines in the first half and sines in the second.
"""
import torch

from nanovllm.kernels.triton_compat import tl, triton


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(x_ptr, stride_token, token, cos, sin,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    offs = token * stride_token + h[:, None] * (2 * HALF) + d[None, :]
    mask = (h < NUM_HEADS)[:, None]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + offs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + offs + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, stride_q, stride_k,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + d)[None, :]
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + d)[None, :]
    _rotate_heads(q_ptr, stride_q, token, cos, sin, NUM_Q_HEADS, BLOCK_QH, HALF)
    _rotate_heads(k_ptr, stride_k, token, cos, sin, NUM_K_HEADS, BLOCK_KH, HALF)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim]; rotated in place."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(1) == head_dim and k.stride(1) == head_dim and q.stride(2) == k.stride(2) == 1
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q.stride(0), k.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_k_heads), HALF=head_dim // 2)
    return q, k
