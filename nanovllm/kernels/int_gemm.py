"""Weight-only integer GEMM: y = x @ W with W stored in 4 or 8 bits, dequantized in registers.

One layout serves AWQ and GPTQ (both are repacked into it once, after loading):
- qweight int32 [in / (32 / bits), out]: consecutive input rows packed per word in plain order
  (row 8r + i in bits [4i, 4i + 4) for 4 bits), so a tile of rows is one load per column; except
  in the 4-bit layers that int4_gemv and int4_gemm take (`in_step_order`), packed a step of 128
  rows at a time with a stride of 16: word r of a step holds its rows 16i + r (i = 0..7, in bits
  [4i, 4i + 4)). Those kernels turn a word's rows into the matrix cores' operand registers, whose
  columns then run in x's own order, so x is read as it is (plain order needed a copy of x in the
  words' order before each product);
- scales [groups, out] and scaled_zeros [groups, out] in the activation dtype, with
  W[k, n] = q[k, n] * scales[g, n] - scaled_zeros[g, n] (zeros pre-multiplied: one FMA per weight);
- the group g of input row k: k // group_size, or g_idx[k] for GPTQ act-order checkpoints, whose
  groups are not runs of rows (the tile then gathers its scales row by row).

Launch shapes of one kernel. Decode (a few rows): the product is bound by reading the weight
bytes, so the K dimension is split over programs (SPLIT_K) to put every SM on the weight stream,
and the partial products meet in a float32 buffer by atomic adds. More rows: a tile of the weight
is dequantized to the activation dtype and fed to the tensor cores, swapped (out^T = W^T x^T, the
weight tile as the register operand) from 17 rows, K walked by one program or two.
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.triton_compat import tl, triton

STEP = 128      # input rows of one step of the 4-bit kernels: 16 packed words of each column


def in_step_order(k: int, bits: int, group_size: int, act_order: bool) -> bool:
    """Whether a layer of k input rows is packed a step at a time (the module docstring): 4 bits,
    no act order (a g_idx), groups of whole steps dividing K."""
    return bits == 4 and not act_order and group_size % STEP == 0 and k % group_size == 0


def to_step_order(rows: torch.Tensor) -> torch.Tensor:
    """[K, ...] in plain order -> in packing order: each step's row 16i + r moved to 8r + i."""
    return rows.reshape(rows.shape[0] // STEP, 8, 16, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def from_step_order(rows: torch.Tensor) -> torch.Tensor:
    """The inverse of to_step_order."""
    return rows.reshape(rows.shape[0] // STEP, 16, 8, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


@triton.jit
def packed_position(ks, BITS: tl.constexpr, STEP_ORDER: tl.constexpr):
    """The word and the slot (bits [BITS * slot, BITS * (slot + 1))) that hold input rows ks."""
    if STEP_ORDER:      # row 16i + r of a step: word r of its 16, slot i
        word, slot = (ks // 128) * 16 + ks % 16, (ks % 128) // 16
    else:
        word, slot = ks // (32 // BITS), ks % (32 // BITS)
    return word, slot


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor, bits: int,
                      group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The common layout -> W [in, out] in float32 (computed as the kernel does: q * s - z * s)."""
    per_word = 32 // bits
    shifts = (torch.arange(per_word, device=qweight.device) * bits).reshape(1, -1, 1)
    q = ((qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1, qweight.shape[1])
    if in_step_order(q.shape[0], bits, group_size, g_idx is not None):
        q = from_step_order(q)
    rows = torch.arange(q.shape[0], device=q.device)
    groups = g_idx.long() if g_idx is not None else rows // group_size
    return q.float() * scales.float()[groups] - scaled_zeros.float()[groups]


def int_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
                 bits: int, group_size: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin of int_gemm: the weight rounded to x's dtype, products summed in float32."""
    w = dequantize_packed(qweight, scales, scaled_zeros, bits, group_size, g_idx).to(x.dtype)
    return (x.float() @ w.float()).to(x.dtype)


@triton.jit(do_not_specialize=["M"])   # one compiled kernel for every row count (graphs capture many)
def _int_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, M, N, K,
                     BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_G_IDX: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, ONE_GROUP_PER_TILE: tl.constexpr,
                     UNPACK_BY_RESHAPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, SWAPPED: tl.constexpr = False,
                     STEP_ORDER: tl.constexpr = False):
    PER_WORD: tl.constexpr = 32 // BITS
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    if SWAPPED:     # out^T, summed as W^T x^T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x_cols = ks
        if UNPACK_BY_RESHAPE and STEP_ORDER:   # the unpacked tile's row 8r + i of a step is input row 16i + r
            x_cols = (ks // 128) * 128 + 16 * (ks % 8) + (ks % 128) // 8
        x = tl.load(x_ptr + rows[:, None] * K + x_cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if UNPACK_BY_RESHAPE:
            # one load per word, its PER_WORD rows spread out in registers
            kw = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
            words = tl.load(qweight_ptr + kw[:, None] * N + cols[None, :],
                            mask=(kw < K // PER_WORD)[:, None] & col_ok[None, :], other=0)
            shifts = tl.arange(0, PER_WORD) * BITS
            q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), (BLOCK_K, BLOCK_N))
        else:
            word, slot = packed_position(ks, BITS, STEP_ORDER)
            # each word loaded once per row it serves: the repeated addresses are one memory transaction
            words = tl.load(qweight_ptr + word[:, None] * N + cols[None, :],
                            mask=k_ok[:, None] & col_ok[None, :], other=0)
            q = (words >> (slot * BITS)[:, None]) & ((1 << BITS) - 1)
        if ONE_GROUP_PER_TILE:
            group = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        else:
            if HAS_G_IDX:
                groups = tl.load(g_idx_ptr + ks, mask=k_ok, other=0)
            else:
                groups = ks // GROUP_SIZE
            offsets = groups[:, None] * N + cols[None, :]
            mask = k_ok[:, None] & col_ok[None, :]
            s = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * s - z).to(x.dtype)
        if SWAPPED:     # the weight tile the register operand: it skips shared memory
            acc = tl.dot(tl.trans(w), tl.trans(x), acc, input_precision=INPUT_PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=INPUT_PRECISION)
    if SWAPPED:
        acc = tl.trans(acc)
    out = out_ptr + rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K > 1:
        # relaxed: the sums are read only after this kernel ends (the default, acq_rel, fences each add)
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


class LaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int            # programs sharing one output tile's K range (float32 atomic partial sums)
    num_warps: int
    num_stages: int
    unpack_by_reshape: bool  # load each word once and spread its rows, or load it once per row
    swapped: bool = False    # out^T = W^T x^T: the dequantized weight feeds the matrix cores from registers


# Chosen by sweeps on an H100 (Qwen3-8B projections, 4 bits, group 128, bfloat16; docs/benchmarks.md).
# Up to 16 rows the decode shape (4-bit layers without act order take int4_gemv there). From 17 rows
# the product runs swapped, out^T = W^T x^T: the dequantized weight tile is the matrix cores'
# register operand and never goes through shared memory (the plain shapes stored it 16 bits at a
# time); the shape grows with the rows, the first that covers them (the last beyond): four
# projections of 36 layers took 6.41 / 7.91 / 11.40 / 14.47 ms at 32 / 64 / 128 / 256 rows, against
# 9.41 / 9.44 / 11.78 / 17.35 for the plain 64x64 tile. From int_dequantize.DEQUANTIZE_FROM_ROWS the
# weight-only linear multiplies the dequantized weight instead (faster than any tile here).
DECODE_MAX_ROWS = 16
DECODE_CONFIG = LaunchConfig(16, 64, 128, 4, 4, 4, True)
SWAPPED_CONFIGS = [(48, LaunchConfig(32, 64, 128, 2, 4, 3, True, True)),
                   (96, LaunchConfig(64, 64, 128, 2, 4, 3, True, True)),
                   (192, LaunchConfig(64, 64, 128, 1, 4, 3, True, True)),
                   (None, LaunchConfig(128, 64, 128, 1, 4, 3, True, True))]


def launch_config(m: int) -> LaunchConfig:
    """The launch shape for m rows."""
    if m <= DECODE_MAX_ROWS:
        return DECODE_CONFIG
    return next(config for most_rows, config in SWAPPED_CONFIGS if most_rows is None or m <= most_rows)


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
             bits: int, group_size: int, g_idx: torch.Tensor | None = None,
             config: LaunchConfig | None = None) -> torch.Tensor:
    """x [M, K] contiguous @ the packed weight -> [M, N] in x's dtype. x is float16 or bfloat16 on
    CUDA (float32 failed to compile there, on an H100 with Triton 3.6); float32 too in the interpreter."""
    if x.is_cuda and x.dtype == torch.float32:
        raise TypeError("int_gemm: x must be float16 or bfloat16 on CUDA; use int_gemm_ref for float32")
    m, k = x.shape
    n = qweight.shape[1]
    block_m, block_n, block_k, split_k, num_warps, num_stages, by_reshape, swapped = config or launch_config(m)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    split_k = max(1, min(split_k, k // block_k))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    one_group = g_idx is None and group_size % block_k == 0
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _int_gemm_kernel[grid](x, qweight, scales, scaled_zeros, g_idx if g_idx is not None else qweight, out, m, n, k,
                           BITS=bits, GROUP_SIZE=group_size, HAS_G_IDX=g_idx is not None,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                           K_PER_SPLIT=k_per_split, ONE_GROUP_PER_TILE=one_group,
                           UNPACK_BY_RESHAPE=by_reshape, SWAPPED=swapped,
                           STEP_ORDER=in_step_order(k, bits, group_size, g_idx is not None),
                           INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                           num_warps=num_warps, num_stages=num_stages)
    return out.to(x.dtype) if split_k > 1 else out
