"""Float8 (e4m3) storage for the KV cache: how values are quantised, checked and scaled.

A cached key or value x of KV head h is stored as e4m3(clamp(x / scale[h], -448, 448)) and read
back as stored * scale[h]. A scale is a float32 tensor of one element (one scale for the layer) or
of num_kv_heads elements (one per KV head). The kernels read it from device memory, so scales can
change without recompiling and CUDA graphs capture them by address.

e4m3 keeps 3 mantissa bits: a value inside the scaled range is stored with a relative error of at
most 2^-4 (6.25%; about 2.6% root-mean-square on Gaussian data), and values below 2^-6 * scale
(e4m3's subnormals) keep an absolute error of at most 2^-10 * scale. Values beyond 448 * scale are
clipped to it.
"""
import torch

from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX

SCALE_FLOOR = 1e-6 / FP8_MAX   # a layer whose K or V never exceeds 1e-6 still gets a usable scale


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [..., num_kv_heads, head_dim] -> e4m3 of x / scale, clamped to +-448 (the torch twin of
    the store kernels; the division is float32 and correctly rounded, as in the kernels)."""
    return (x.float() / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., num_kv_heads, head_dim] e4m3 -> x * scale in dtype."""
    return (x.float() * scale.reshape(-1, 1)).to(dtype)


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> int:
    """Validate the scales for a [num_blocks, block_size, num_kv_heads, head_dim] cache pair.
    Returns the stride between KV heads' scales: 0 for one scale per layer, 1 for one per head
    (also 0 for a 16-bit cache, which takes no scales). Shapes and dtypes only: values are not
    read, which would wait for the GPU."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype")
    if not is_fp8_cache(k_cache):
        if k_cache.element_size() == 1:
            raise ValueError(f"k_cache: 8-bit caches must be {FP8_DTYPE}, got {k_cache.dtype}")
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is not None:
                raise ValueError(f"{name} is given but the cache is {k_cache.dtype}, not {FP8_DTYPE}")
        return 0
    num_kv_heads = k_cache.shape[2]
    numels = set()
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name} is required for a {FP8_DTYPE} cache")
        if s.dtype != torch.float32 or s.device != k_cache.device:
            raise ValueError(f"{name} must be float32 on {k_cache.device}, got {s.dtype} on {s.device}")
        if s.numel() not in (1, num_kv_heads) or not s.is_contiguous():
            raise ValueError(f"{name} must hold 1 or num_kv_heads={num_kv_heads} contiguous values, "
                             f"got shape {tuple(s.shape)}")
        numels.add(s.numel())
    if len(numels) > 1:
        raise ValueError("k_scale and v_scale must both be per layer or both per KV head")
    return 0 if numels == {1} else 1


def kv_scale_from_absmax(x: torch.Tensor, per_head: bool = False, floor: float = SCALE_FLOOR) -> torch.Tensor:
    """A scale for storing x (observed keys or values, [..., num_kv_heads, head_dim]) as e4m3 when
    the checkpoint brings none: max |x| / 448, over the whole layer or per KV head, at least floor.

    The largest observed value then maps to e4m3's largest (448), so nothing seen is clipped and
    every value keeps e4m3's 3-bit mantissa: at most 6.25% relative error per element (about 2.6%
    root-mean-square). Measured on Gaussian K/V (tests/test_kernels_fp8.py), an attention output
    moves by 3-4% of its norm with unit-variance queries and up to ~7% with a sharper softmax,
    i.e. 0.1-2% of the values' RMS. Later values larger than any observed are clipped to
    448 * scale, so observe a representative batch (e.g. the prompts of the first steps). The floor
    keeps a layer of zeros from dividing by zero."""
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"x: expected observed values [..., num_kv_heads, head_dim], got shape {tuple(x.shape)}")
    absmax = x.detach().abs().float()
    absmax = absmax.reshape(-1, *x.shape[-2:]).amax(dim=(0, 2)) if per_head else absmax.amax().reshape(1)
    if not torch.isfinite(absmax).all():
        raise ValueError("x: observed keys or values hold inf or NaN")
    return (absmax / FP8_MAX).clamp_min(floor)
