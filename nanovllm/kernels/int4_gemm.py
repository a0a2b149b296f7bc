"""Products of decode batches (from 17 rows) with 4-bit weights in int_gemm's layout (AWQ and GPTQ after
loading): y = x @ W, W[k, n] = q[k, n] * scales[g, n] - scaled_zeros[g, n], g = k // group_size.

From about a hundred rows the matrix cores are the pace, so the weight must reach them as 16-bit
floats for about one instruction a weight. The product runs swapped, out^T = W^T x^T: a tile of
the weight is dequantized in registers and is the register operand of the matrix cores, the rows
of x come through shared memory. Two packed words a, b of one column (words r and r + 1 of a step
in int_gemm's step order: input rows 16i + r and 16i + r + 1 in bits [4i, 4i + 4)) give 16 weights
in about 32 instructions (`dequantize_asm`): int4_gemv's unpacking to 16-bit floats OFFSET + q (a
prmt per half word, a shift and a lop3 per row), then per pair of weights one packed subtract of
OFFSET (exact) and one packed fused multiply-add, q * s - z, rounded once as the twin rounds it. A
register so holds rows 16i + r and 16i + r + 1 of one column, neighbours as the matrix cores want
them. A step of 128 input rows is two products: rows i = 0-3 of the words, then i = 4-7, each
joined into a [64, BLOCK_N] tile whose row 16i + r is word r's row i (joins and reshapes that only
rename registers), which is the step's input row 16i + r: x is read as it is (in plain order it
was copied into this order before every product, a kernel per product), its tiles loaded ahead by the
software pipeline with the packed words. Each half adds into its own float32 sums: with one
accumulator Triton waits for the first product before the second half is dequantized; with two
it keeps the products in flight, so each half's dequantization runs while the matrix cores work
(8B projections x36 at 240 rows 10.26 -> 9.63 ms on an H200).
A step lies inside one group: groups of at least 128 rows that divide K. Few column tiles (o_proj,
down_proj) leave SMs idle, so K is split there, the splits' sums meeting in slices (split_slices.py:
the last to arrive adds them and writes the output, no kernels around this one).
Triton's CPU interpreter runs no inline PTX: there the weight is dequantized by integer shifts and
float32 math. The torch twin is int_gemm's: `int_gemm_ref`.
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.int4_gemv import MAGIC
from nanovllm.kernels.int_gemm import STEP, in_step_order
from nanovllm.kernels.split_slices import add_split_slices, split_slices
from nanovllm.kernels.triton_compat import tl, triton


class Int4GemmConfig(NamedTuple):
    block_n: int        # output columns per program (the matrix cores' M side, 64 per warp group)
    block_m: int        # rows of x per program (their N side: each weight dequantized once for them)
    num_warps: int
    num_stages: int


# From sweeps of the Qwen3-8B projections on one H200 (`scripts/int_gemm_bench.py --int4-gemm --sweep`,
# 2026-12-02, docs/benchmarks.md). Up to 32 rows 64 x 32 tiles of one warp group (112 registers: four
# programs an SM), up to 64 rows 64 x 64 (three an SM), K split in four but for outputs of at least
# 4x the inputs (gate_up, K whole): the best launch of every projection at 17-64 rows (x36 at 32 rows
# 3.28 ms on 64 x 32 against 3.74 on 64 x 64, bf16 3.96). From 65 rows 128 x 128 tiles of two warp
# groups; K whole for outputs of 4x the inputs up to 128 rows (gate_up at 128 rows 74.0 against 77.2
# us split in two), else split where K >= N (o_proj, down_proj: few column tiles, long runs of K) in
# four up to 128 rows and in two above, where K < N in two up to 128 rows and not at all above (at
# 128 and 240 rows the best launch or within 3%). At 1,024 rows int_gemm wins (31.3 against 37.7 ms).
# The weight-only linear sends int4_gemv.GEMV_MAX_ROWS + 1 rows up to
# int_dequantize.DEQUANTIZE_FROM_ROWS here on CUDA.
SMALL_CONFIG = Int4GemmConfig(64, 32, 4, 3)
FEW_ROWS_CONFIG = Int4GemmConfig(64, 64, 4, 3)
CONFIG = Int4GemmConfig(128, 128, 8, 4)


def dequantize_asm(dtype: torch.dtype, first_row: int) -> str:
    """The PTX that turns two words a ($4), b ($5) of one column, with that column's scale pair ($6)
    and negated scaled zero pair ($7), into rows first_row .. first_row + 3 (0 or 4) of weights: $j =
    (row first_row + j of b) << 16 | (that row of a), each q * s - z in 16 bits. prmt gathers that
    half (rows 0-3 or 4-7) of both words; per row a shift and a lop3, (t & 0x000F000F) | MAGIC, make
    the pair OFFSET + q (int4_gemv.unpack_asm); sub removes OFFSET exactly and fma scales, rounding once."""
    magic_bits, _ = MAGIC[dtype]
    kind = "bf16x2" if dtype == torch.bfloat16 else "f16x2"
    magic = f"{magic_bits * 0x10001:#010x}"
    lines = [f"prmt.b32 h, $4, $5, {'0x5410' if first_row == 0 else '0x7632'};", f"mov.b32 m, {magic};"]
    for j in range(4):
        source = "h"
        if j:
            lines.append(f"shr.u32 t, h, {4 * j};")
            source = "t"
        lines.append(f"lop3.b32 t, {source}, 0x000F000F, {magic}, 0xEA;")
        lines.append(f"sub.rn.{kind} t, t, m;")
        lines.append(f"fma.rn.{kind} ${j}, t, $6, $7;")
    return "{\n.reg .b32 h, t, m;\n" + "\n".join(lines) + "\n}"


@triton.jit
def _dequantize_row(words, s, neg_z, I: tl.constexpr, DTYPE: tl.constexpr):
    """Row I of each word as weights q * s - z in DTYPE, by integer and float32 math (the interpreter's path)."""
    q = ((words >> (4 * I)) & 0xF).to(tl.float32)
    return (q * s.to(tl.float32) + neg_z.to(tl.float32)).to(DTYPE)


@triton.jit
def _dequantize_half(words, s, neg_z, FIRST: tl.constexpr, ASM: tl.constexpr, USE_PTX: tl.constexpr,
                     DTYPE: tl.constexpr):
    """Rows FIRST .. FIRST + 3 of each word as weights in DTYPE (s and neg_z broadcast to the words' shape)."""
    if USE_PTX:
        rows = tl.inline_asm_elementwise(
            asm=ASM, constraints="=r,=r,=r,=r,r,r,r,r", args=[words, s, neg_z],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=2)
        return (rows[0].to(DTYPE, bitcast=True), rows[1].to(DTYPE, bitcast=True),
                rows[2].to(DTYPE, bitcast=True), rows[3].to(DTYPE, bitcast=True))
    else:
        return (_dequantize_row(words, s, neg_z, FIRST, DTYPE), _dequantize_row(words, s, neg_z, FIRST + 1, DTYPE),
                _dequantize_row(words, s, neg_z, FIRST + 2, DTYPE), _dequantize_row(words, s, neg_z, FIRST + 3, DTYPE))


@triton.jit
def _half_tile(w):
    """Four [WORDS, BLOCK_N] rows i of the words as one [4 * WORDS, BLOCK_N] tile whose row 16i + r
    is word r's row i (joins and reshapes that only rename registers: no data moves)."""
    quad = tl.join(tl.join(w[0], w[1]), tl.join(w[2], w[3]))
    return tl.reshape(tl.permute(quad, (3, 2, 0, 1)), (4 * w[0].shape[0], w[0].shape[1]))


@triton.jit(do_not_specialize=["M", "NUM_SPLITS"])   # one compiled kernel for every row and split count
def _int4_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, partial_ptr, arrivals_ptr,
                      M, N, K, K_PER_SPLIT, NUM_SPLITS,
                      GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                      ASM_LOW: tl.constexpr, ASM_HIGH: tl.constexpr, USE_PTX: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    WORDS: tl.constexpr = 16
    STEP: tl.constexpr = 128
    # row tiles of one column tile run together: one weight read
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    dtype = x_ptr.dtype.element_ty
    slab = tl.arange(0, WORDS)
    half = tl.arange(0, STEP // 2)
    acc_low = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)     # out^T
    acc_high = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * K_PER_SPLIT
    # a count of steps the compiler sees is at least one (the host never launches an empty split): with
    # a loop that may run zero times, the sums' zeros are set again on the path around it, and ptxas
    # then waits for every product before the next (C7515 'wgmma.mma_async instructions are serialized')
    steps = tl.maximum(tl.cdiv(tl.minimum(K_PER_SPLIT, K - k_start), STEP), 1)
    for step in tl.range(0, steps, num_stages=NUM_STAGES):
        k0 = k_start + step * STEP
        kw = k0 // 8 + slab
        words = tl.load(qweight_ptr + kw[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0)
        group = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0)
        neg_z = -tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0)
        s = tl.broadcast_to(s[None, :], (WORDS, BLOCK_N))
        neg_z = tl.broadcast_to(neg_z[None, :], (WORDS, BLOCK_N))
        # rows 0-3 of the words, then 4-7: two products, each into its own sums (see the docstring)
        low = _half_tile(_dequantize_half(words, s, neg_z, 0, ASM_LOW, USE_PTX, dtype))
        x = tl.load(x_ptr + rows[:, None] * K + (k0 + half)[None, :], mask=row_ok[:, None], other=0.0)
        acc_low = tl.dot(tl.trans(low), tl.trans(x), acc_low, input_precision=INPUT_PRECISION)
        high = _half_tile(_dequantize_half(words, s, neg_z, 4, ASM_HIGH, USE_PTX, dtype))
        x = tl.load(x_ptr + rows[:, None] * K + (k0 + STEP // 2 + half)[None, :], mask=row_ok[:, None], other=0.0)
        acc_high = tl.dot(tl.trans(high), tl.trans(x), acc_high, input_precision=INPUT_PRECISION)
    acc = acc_low + acc_high
    offsets = rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        add_split_slices(tl.trans(acc), partial_ptr, out_ptr, offsets, mask, pid_k, NUM_SPLITS, M * N,
                         arrivals_ptr + pid_n * tl.num_programs(0) + pid_m)
    else:
        tl.store(out_ptr + offsets, tl.trans(acc).to(out_ptr.dtype.element_ty), mask=mask)


def gemm_supported(k: int, group_size: int, g_idx: torch.Tensor | None, bits: int) -> bool:
    """Whether int4_gemm takes this layer: packed in step order (int_gemm.in_step_order)."""
    return in_step_order(k, bits, group_size, g_idx is not None)


def launch_for(m: int, n: int, k: int) -> tuple[Int4GemmConfig, int]:
    """The tile and the K split for an [m, k] @ [k, n] product."""
    tile = SMALL_CONFIG if m <= 32 else FEW_ROWS_CONFIG if m <= 64 else CONFIG
    if m > 128:
        return tile, 2 if k >= n else 1
    if n >= 4 * k:      # gate_up: column tiles enough without a split
        return tile, 1
    return tile, 4 if m <= 64 or k >= n else 2


def k_splits(k: int, split_k: int) -> tuple[int, int]:
    """(input rows per split, whole steps; the splits that makes) for K split in about split_k."""
    split_k = max(1, min(split_k, k // STEP))
    k_per_split = triton.cdiv(k // STEP, split_k) * STEP
    return k_per_split, triton.cdiv(k, k_per_split)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
              group_size: int, config: Int4GemmConfig | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ the 4-bit packed weight -> [M, N] in x's dtype: bfloat16/float16 on CUDA (float32
    too in the interpreter). Needs gemm_supported(K, group_size, None, 4). `int_gemm_ref` is the twin."""
    m, k = x.shape
    n = qweight.shape[1]
    if not gemm_supported(k, group_size, None, 4):
        raise ValueError(f"int4_gemm: group_size {group_size} must be a multiple of {STEP} dividing K = {k}; "
                         "use int_gemm")
    if x.is_cuda and x.dtype not in MAGIC:
        raise TypeError(f"int4_gemm: x must be bfloat16 or float16 on CUDA, got {x.dtype}")
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"int4_gemm: qweight has {qweight.shape[0]} packed rows, K = {k} needs {k // 8}")
    chosen, chosen_split = launch_for(m, n, k)
    block_n, block_m, num_warps, num_stages = config or chosen
    k_per_split, split_k = k_splits(k, split_k or chosen_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    use_ptx = x.is_cuda and x.dtype in MAGIC
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    partial, arrivals = split_slices(out, split_k, grid[0] * grid[1])
    _int4_gemm_kernel[grid](x, qweight, scales, scaled_zeros, out, partial, arrivals, m, n, k,
                            k_per_split, split_k, GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_M=block_m,
                            SPLIT=split_k > 1, ASM_LOW=dequantize_asm(x.dtype, 0) if use_ptx else "",
                            ASM_HIGH=dequantize_asm(x.dtype, 4) if use_ptx else "", USE_PTX=use_ptx,
                            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                            NUM_STAGES=num_stages, num_warps=num_warps)
    return out
