"""Prefills with integer weights: the layer's weight dequantized to 16 bits in a scratch buffer, then
one cuBLAS GEMM. Past a few hundred rows a product is bound by the matrix cores, and cuBLAS on
16-bit weights runs them faster than our fused kernels (int4_gemm, int_gemm) do after unpacking
in registers; writing and reading back the 16-bit weight costs about as much as one more read of
it, paid once per call whatever the rows.

The kernel computes what the twin computes (int_gemm.dequantize_packed: q * s - z in float32,
rounded once to the activation dtype), for int_gemm's layout: 4 or 8 bits, groups as runs of rows
or through g_idx (act order), rows in plain or step order. The scratch buffer is one per (device,
dtype), sized by the largest layer it has served; it settles during the first prefill (the memory
profile's), before the KV cache is sized and before CUDA graphs are captured.
"""
import torch

from nanovllm.kernels.int_gemm import in_step_order, packed_position
from nanovllm.kernels.triton_compat import tl, triton

# From this many rows the weight-only linear multiplies the dequantized weight: the 8B projections of 36
# layers on one H200 (`scripts/int_gemm_bench.py --int4-gemm`, docs/benchmarks.md) took 12.83 ms this way
# against int4_gemm's 12.25 at 256 rows, 15.61 against 18.13 at 384, 25.28 against int_gemm's 31.37 at
# 1,024 and 83.58 against 125.24 at 4,096 (bf16 81.91). Against Hopper's int4_gemm_hopper (2026-12-03):
# 10.37 against 7.44 ms at 256 rows, 11.44 against 12.95 at 320, 23.57 against 31.22 at 1,024
DEQUANTIZE_FROM_ROWS = 320

_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


@triton.jit
def _dequantize_kernel(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, K, N,
                       BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr,
                       STEP_ORDER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (ks < K)[:, None] & (cols < N)[None, :]
    word, slot = packed_position(ks, BITS, STEP_ORDER)
    # each word loaded once per row it holds: the repeated addresses are one memory transaction
    words = tl.load(qweight_ptr + word[:, None] * N + cols[None, :], mask=mask, other=0)
    q = (words >> (slot * BITS)[:, None]) & ((1 << BITS) - 1)
    if HAS_G_IDX:
        groups = tl.load(g_idx_ptr + ks, mask=ks < K, other=0)
    else:
        groups = ks // GROUP_SIZE
    offsets = groups[:, None] * N + cols[None, :]
    s = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + ks[:, None] * N + cols[None, :], (q.to(tl.float32) * s - z).to(out_ptr.dtype.element_ty),
             mask=mask)


def release_scratch() -> None:
    """Drop the scratch buffers (the engine's sleep, once no CUDA graph holds them)."""
    _scratch.clear()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor, bits: int,
               group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """W [K, N] in the scales' dtype, in the scratch buffer (valid until the next call on this
    device and dtype)."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    key = (qweight.device, scales.dtype)
    if key not in _scratch or _scratch[key].numel() < k * n:
        _scratch[key] = torch.empty(k * n, dtype=scales.dtype, device=qweight.device)
    out = _scratch[key][:k * n].view(k, n)
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 128))
    _dequantize_kernel[grid](qweight, scales, scaled_zeros, g_idx if g_idx is not None else qweight, out, k, n,
                             BITS=bits, GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None,
                             STEP_ORDER=in_step_order(k, bits, group_size, g_idx is not None), BLOCK_K=64, BLOCK_N=128)
    return out


def dequantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
                       bits: int, group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the packed weight -> [M, N]: the weight dequantized to x's dtype, then torch.mm.
    `int_gemm_ref` is the twin."""
    return torch.mm(x, dequantize(qweight, scales.to(x.dtype), scaled_zeros.to(x.dtype), bits, group_size, g_idx))
