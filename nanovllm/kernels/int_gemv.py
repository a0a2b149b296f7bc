"""Few-row products with weights packed in 4 or 8 bits (int_gemm's layout, AWQ and GPTQ after
loading): y = x @ W, W[k, n] = q[k, n] * scales[g, n] - scaled_zeros[g, n], g = k // group_size.

At decode the weight bytes are the whole cost. Each program streams BLOCK_N contiguous packed
columns (16-byte loads along the output features) for a range of input rows, unpacks the words in
registers and sums in float32; K is split over programs when the columns alone leave too few
programs to fill the GPU. Every loop step lies inside one group (one scale and zero per column).
One row dequantizes each weight and multiplies element-wise, reducing once at the end; 2 to 16
rows use a 16-row matrix-core product of x and the raw integers (exact in 16 bits), the step's
scale and zero applied to its sums: sum_k x[k] W[k, n] = s[n] sum_k x[k] q[k, n] - z[n] sum_k x[k].
Act-order layers (a g_idx) stay on int_gemm.
`int_gemv_ref` is the torch twin.
"""
import torch

from nanovllm.kernels.fp8_gemv import GemvConfig, split_k_for
from nanovllm.kernels.int_gemm import dequantize_packed
from nanovllm.kernels.triton_compat import pdl_launch, tl, triton, wait_for_previous_kernel

# The weight-only linear sends products of at most this many rows here on CUDA (the rest, and
# act-order layers, to int_gemm). To be set from `scripts/int_gemm_bench.py --gemv` on an H100.
GEMV_MAX_ROWS = 16

# (packed columns, input rows per step, warps, stages): 16-byte loads of 4 words across the columns
ONE_ROW_CONFIG = GemvConfig(64, 128, 4, 4)
FEW_ROWS_CONFIG = GemvConfig(64, 128, 4, 4)


def int_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
                 bits: int, group_size: int) -> torch.Tensor:
    """The torch twin: the float32 product of x and the dequantized weight, in x's dtype."""
    return (x.float() @ dequantize_packed(qweight, scales, scaled_zeros, bits, group_size)).to(x.dtype)


def step_rows(k: int, group_size: int, block_k: int) -> int | None:
    """Input rows per loop step: a power of two of at least 16 that keeps each step inside one
    group (a divisor of group_size, or anything when one group spans K); None when there is none."""
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if group_size >= k:
        return block_k
    step = min(block_k, group_size & -group_size)   # the largest power of two dividing group_size
    return step if step >= 16 else None


def gemv_supported(k: int, group_size: int, g_idx: torch.Tensor | None, config: GemvConfig | None = None) -> bool:
    return g_idx is None and step_rows(k, group_size, (config or ONE_ROW_CONFIG).block_k) is not None \
        and step_rows(k, group_size, (config or FEW_ROWS_CONFIG).block_k) is not None


@triton.jit(do_not_specialize=["M"])
def _int_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, stride_x, GROUP_SIZE,
                     K_PER_SPLIT, BITS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    shifts = tl.arange(0, PER_WORD) * BITS
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if BLOCK_M == 1:
        # the step kept as [words, rows per word, columns]: no reshape, one reduction at the end
        acc3 = tl.zeros((WORDS, PER_WORD, BLOCK_N), dtype=tl.float32)
        rows = pid_m + tl.arange(0, 1)
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_ok = rows < M
    for k0 in range(k_start, k_end, BLOCK_K):
        kw = k0 // PER_WORD + tl.arange(0, WORDS)
        words = tl.load(qweight_ptr + kw.to(tl.int64)[:, None] * N + cols[None, :],
                        mask=(kw < k_end // PER_WORD)[:, None] & col_ok[None, :], other=0)
        # word r holds rows PER_WORD * r + i in bits [BITS * i, BITS * (i + 1)); each integer is
        # widened by writing it into the mantissa of 2^23 (integer ops and one add, not the
        # slower integer-to-float conversion)
        bits = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        q = (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        group = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        z = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        if BLOCK_M == 1:
            ks = kw[:, None] * PER_WORD + tl.arange(0, PER_WORD)[None, :]
            x = tl.load(x_ptr + pid_m * stride_x + ks, mask=ks < k_end, other=0.0).to(tl.float32)
            acc3 += x[:, :, None] * (q * s[None, None, :] - z[None, None, :])
        else:
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & (ks < k_end)[None, :],
                        other=0.0)
            xq = tl.dot(x, tl.reshape(q, (BLOCK_K, BLOCK_N)).to(x.dtype), input_precision=INPUT_PRECISION)
            acc += xq * s[None, :] - tl.sum(x.to(tl.float32), axis=1)[:, None] * z[None, :]
    if BLOCK_M == 1:
        acc = tl.sum(tl.sum(acc3, axis=1), axis=0)[None, :]
    out = out_ptr + rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
             bits: int, group_size: int, config: GemvConfig | None = None, split_k: int | None = None) -> torch.Tensor:
    """The Triton twin of `int_gemv_ref`: x [M, K] (last dimension contiguous) @ the packed weight
    -> [M, N] in x's dtype (float16/bfloat16; float32 in the interpreter). Needs
    gemv_supported(K, group_size, None); meant for M <= GEMV_MAX_ROWS."""
    m, k = x.shape
    n = qweight.shape[1]
    block_m = 1 if m == 1 else 16
    block_n, block_k, num_warps, num_stages = config or (ONE_ROW_CONFIG if m == 1 else FEW_ROWS_CONFIG)
    block_k = step_rows(k, group_size, block_k)
    if block_k is None:
        raise ValueError(f"int_gemv: group_size {group_size} has no power-of-two divisor >= 16; use int_gemm")
    column_programs = triton.cdiv(n, block_n)
    split_k = split_k or split_k_for(x, column_programs, k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    grid = (column_programs, split_k, m if block_m == 1 else triton.cdiv(m, block_m))
    _int_gemv_kernel[grid](x, qweight, scales, scaled_zeros, out, m, n, k, x.stride(0), group_size, k_per_split,
                           BITS=bits, SPLIT=split_k > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                           num_warps=num_warps, num_stages=num_stages, **pdl_launch(x))
    return out.to(x.dtype) if split_k > 1 else out
