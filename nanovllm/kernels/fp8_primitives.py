"""Float8 (e4m3) basics shared by the FP8 kernels: the dtype and its range, an activation quantized
by the kernel that produced it, and the torch twins of quantizing an activation and dequantizing a
weight (per row and group of `group_size` columns). A leaf: it imports no other kernel module.
"""
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # largest finite e4m3fn value

# the smallest activation scale: a token of zeros quantizes to zeros instead of dividing by zero
ACT_SCALE_FLOOR = 1e-12


class QuantizedActivation(NamedTuple):
    """An activation quantized by the kernel that produced it, as `quantize_activation_ref` would:
    q [M, K] e4m3, scale [M, G] float32 (the consumer's group size), dtype: the 16-bit dtype it had."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def num_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def quantize_activation_ref(x: torch.Tensor, group_size: int,
                            static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] e4m3, scales [M, G] float32); a static scale (one element) is used as is."""
    m, k = x.shape
    if static_scale is not None:
        scales = static_scale.float().reshape(1, 1).expand(m, 1)
    else:
        padded = torch.nn.functional.pad(x.float(), (0, num_groups(k, group_size) * group_size - k))
        absmax = padded.abs().reshape(m, -1, group_size).amax(dim=-1)
        # times the float32 reciprocal, not divided: torch divides by a Python number that way on CUDA
        scales = (absmax * (1 / FP8_MAX)).clamp_min(ACT_SCALE_FLOOR)
    x_q = (x.float() / scales.repeat_interleave(group_size, dim=1)[:, :k]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q, scales.contiguous()


def dequantize_ref(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """[R, K] float8 and [R, G] scales -> float32 [R, K]."""
    return q.float() * scales.float().repeat_interleave(group_size, dim=-1)[..., :q.shape[-1]]
