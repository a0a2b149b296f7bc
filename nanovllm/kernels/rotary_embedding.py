"""Rotary position embedding (the rotate-half form), applied to queries and keys in place;
optionally after a per-head RMSNorm (the q_norm and k_norm some families have), and optionally followed by storing
the rotated keys and the values into the paged KV cache. One kernel does all three, one program per
token: a decode step would otherwise spend three more launches per layer on them.

cos_sin_cache: [max_position, head_dim] float32, cosines in the first half and sines in the second.
Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size + offset;
slot -1 marks a padding token (CUDA-graph batches) and is skipped. A float8 e4m3 cache stores
each key and value divided by its scale (see fp8.py), quantised in the same pass.
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.fp8_kv_cache import check_kv_scales, is_fp8_cache, quantize_fp8
from nanovllm.kernels.rms_norm import rms_norm_ref
from nanovllm.kernels.triton_compat import pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel


class KVStore(NamedTuple):
    """Where new keys and values go: the values, the caches and each token's slot (-1 = none);
    for a float8 cache also the scales (float32, 1 or kv_heads values)."""
    value: torch.Tensor          # [tokens, kv_heads, head_dim]
    k_cache: torch.Tensor        # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor   # [tokens]
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class RotaryInputs(NamedTuple):
    """What rotating a step's queries and keys takes besides them (see apply_rotary)."""
    positions: torch.Tensor                                      # [tokens]
    cos_sin_cache: torch.Tensor                                  # [max_position, head_dim] float32
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None   # the q and k norms' weights
    eps: float = 1e-6


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key, value = key[valid], value[valid]
    if is_fp8_cache(k_cache):
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                     norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 1e-6,
                     kv_store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if norm_weights is not None:
        q, k = rms_norm_ref(q, norm_weights[0], eps), rms_norm_ref(k, norm_weights[1], eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype).unsqueeze(1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    q, k = rotate(q), rotate(k)
    if kv_store is not None:
        store_kvcache_ref(k, *kv_store)
    return q, k


@triton.jit
def normed_rotated(x1, x2, weight_ptr, eps, cos, sin, dtype, HALF: tl.constexpr, NORM: tl.constexpr):
    """The two halves of heads [heads, HALF] (float32), normalised (NORM) and rotated, rounded to
    dtype where the unfused rms_norm and rotary round: the fused pass equals norm-then-rotate."""
    if NORM:
        d = tl.arange(0, HALF)
        # the weights are loaded before the sums: a load issued after a reduction across warps waits
        # out its whole latency behind it
        w1 = tl.load(weight_ptr + d).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + d).to(tl.float32)[None, :]
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _rotate_heads(x_ptr, weight_ptr, eps, stride_token, token, cos, sin, NUM_HEADS: tl.constexpr,
                  BLOCK_H: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotate (after normalising) the heads of one token in place; returns the two rotated halves."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    offs = token * stride_token + h[:, None] * (2 * HALF) + d[None, :]
    mask = (h < NUM_HEADS)[:, None]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = normed_rotated(x1, x2, weight_ptr, eps, cos, sin, x_ptr.dtype.element_ty, HALF, NORM)
    tl.store(x_ptr + offs, y1, mask=mask)
    tl.store(x_ptr + offs + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def to_cache(x, scale_ptr, h, dtype, NUM_HEADS: tl.constexpr, SCALE_STRIDE: tl.constexpr, KV_FP8: tl.constexpr):
    """x [heads, d] as the cache stores it; for float8, x / scale (correctly rounded, as torch
    divides) clamped to e4m3's range (fp8.FP8_MAX, 448) before rounding to e4m3."""
    if KV_FP8:
        scale = tl.load(scale_ptr + h * SCALE_STRIDE, mask=h < NUM_HEADS, other=1.0)[:, None]
        return tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0).to(dtype)
    return x.to(dtype)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, q_weight_ptr, k_weight_ptr, eps, stride_q, stride_k,
                   v_ptr, stride_v, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, BLOCK_QH: tl.constexpr,
                   BLOCK_KH: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr,
                   KV_FP8: tl.constexpr, SCALE_STRIDE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token)
    d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + d)[None, :]
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + d)[None, :]
    _rotate_heads(q_ptr, q_weight_ptr, eps, stride_q, token, cos, sin, NUM_Q_HEADS, BLOCK_QH, HALF, NORM)
    k1, k2 = _rotate_heads(k_ptr, k_weight_ptr, eps, stride_k, token, cos, sin, NUM_K_HEADS, BLOCK_KH, HALF, NORM)
    if STORE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_KH)
            mask = (h < NUM_K_HEADS)[:, None]
            row = h[:, None] * (2 * HALF) + d[None, :]
            cache_offs = slot * (NUM_K_HEADS * 2 * HALF) + row
            dtype = k_cache_ptr.dtype.element_ty   # float8: quantised from k as rounded to its dtype, like the twin
            tl.store(k_cache_ptr + cache_offs, to_cache(k1, k_scale_ptr, h, dtype, NUM_K_HEADS, SCALE_STRIDE, KV_FP8),
                     mask=mask)
            tl.store(k_cache_ptr + cache_offs + HALF,
                     to_cache(k2, k_scale_ptr, h, dtype, NUM_K_HEADS, SCALE_STRIDE, KV_FP8), mask=mask)
            v1 = tl.load(v_ptr + token * stride_v + row, mask=mask)
            v2 = tl.load(v_ptr + token * stride_v + row + HALF, mask=mask)
            tl.store(v_cache_ptr + cache_offs, to_cache(v1, v_scale_ptr, h, dtype, NUM_K_HEADS, SCALE_STRIDE, KV_FP8),
                     mask=mask)
            tl.store(v_cache_ptr + cache_offs + HALF,
                     to_cache(v2, v_scale_ptr, h, dtype, NUM_K_HEADS, SCALE_STRIDE, KV_FP8), mask=mask)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                 norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 1e-6,
                 kv_store: KVStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, q_heads, head_dim], k: [tokens, kv_heads, head_dim]; rotated in place, each head
    first RMS-normalised with norm_weights = (q weight, k weight) when given; then, given kv_store,
    the rotated keys and the values are written to their cache slots (a float8 cache quantised
    with kv_store's k_scale and v_scale)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(1) == head_dim and k.stride(1) == head_dim and q.stride(2) == k.stride(2) == 1
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    q_weight, k_weight = norm_weights if norm_weights is not None else (q, k)   # unused
    value, k_cache, v_cache, slots, k_scale, v_scale = kv_store or KVStore(k, k, k, positions)   # unused
    scale_stride = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    fp8 = is_fp8_cache(k_cache)
    if kv_store is not None:
        assert value.shape == k.shape and value.stride(1) == head_dim and value.stride(2) == 1
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == k.shape[1:]
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_weight, k_weight, eps, q.stride(0), k.stride(0),
        value, value.stride(0), k_cache, v_cache, slots, *((k_scale, v_scale) if fp8 else (k, k)),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_k_heads), HALF=head_dim // 2, NORM=norm_weights is not None,
        STORE=kv_store is not None, KV_FP8=fp8, SCALE_STRIDE=scale_stride, **pdl_launch(q))
    return q, k
