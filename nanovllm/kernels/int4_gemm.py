"""Products of decode batches (from 65 rows) with 4-bit weights in int_gemm's layout (AWQ and GPTQ after
loading): y = x @ W, W[k, n] = q[k, n] * scales[g, n] - scaled_zeros[g, n], g = k // group_size.

From about a hundred rows the matrix cores are the pace, so the weight must reach them as 16-bit
floats for about one instruction a weight. The product runs swapped, out^T = W^T x^T: a tile of
the weight is dequantized in registers and is the register operand of the matrix cores, the rows
of x come through shared memory. Two packed words a, b of one column (input rows 8r + i and
8(r + 1) + i in bits [4i, 4i + 4)) give 16 weights in about 32 instructions (`dequantize_asm`):
int4_gemv's unpacking to 16-bit floats OFFSET + q (a prmt per half word, a shift and a lop3 per
row), then per pair of weights one packed subtract of OFFSET (exact) and one packed fused
multiply-add, q * s - z, rounded once as the twin rounds it. A register so holds rows 8r + i and
8(r + 1) + i of one column; the 8 results are joined into one [128, BLOCK_N] tile whose row 16i + r
is input row 8r + i (joins and reshapes that only rename registers), and x comes interleaved to
match (`interleave_rows`, one small kernel: x[:, 8r + i] moved to column 16i + r of each 128), so a step of 128
input rows is one product, its x tile loaded ahead by the software pipeline with the packed words.
A step lies inside one group: groups of at least 128 rows that divide K. Few column tiles (o_proj,
down_proj) leave SMs idle, so K is split there: the splits add into float32 sums in a zeroed
workspace and the last to arrive writes the output (no kernels around this one).
Triton's CPU interpreter runs no inline PTX: there the weight is dequantized by integer shifts and
float32 math. The torch twin is int_gemm's: `int_gemm_ref`.
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.int4_gemv import MAGIC, bitcast_rows
from nanovllm.kernels.triton_compat import pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel
from nanovllm.kernels.zeroed_workspace import zeroed_workspace

STEP = 128          # input rows per loop step: 16 packed words of each column


class Int4GemmConfig(NamedTuple):
    block_n: int        # output columns per program (the matrix cores' M side, 64 per warp group)
    block_m: int        # rows of x per program (their N side: each weight dequantized once for them)
    num_warps: int
    num_stages: int


# From sweeps of the Qwen3-8B projections on one H200 (`scripts/int_gemm_bench.py --int4-gemm --sweep`,
# docs/benchmarks.md): up to 128 rows tiles of 64 columns, K split in two (four projections of 36 layers
# 6.59 ms at 128 rows, int_gemm 11.83); from 129 rows tiles of 128 x 128 in two warp groups, K split
# in two where K >= N (o_proj, down_proj: few column tiles, long runs of K): 10.24 ms at 256 rows
# (11.47 split everywhere), int_gemm 14.90; 19.89 against 24.44 at 512 rows. At 1,024 rows int_gemm
# wins (31.3 against 37.7 ms). Two pipeline stages (more programs per SM) ranked in no projection's best four.
# Up to 128 rows two shapes run better (2026-12-02, 96 and 128 rows, 9 tiles x split 1/2/4, 6.37 ->
# 5.98 ms at 128 rows): outputs of at least 4x the inputs (gate_up) in 256-column tiles of 16 warps,
# K whole (80.5 -> 76.1 us); inputs of at least 2x the outputs (down_proj) in 128 x 128 tiles, K split
# in four (45.7 -> 39.7 us).
# The weight-only linear sends 65 rows up to int_dequantize.DEQUANTIZE_FROM_ROWS here on CUDA.
FEW_ROWS_CONFIG = Int4GemmConfig(64, 128, 4, 3)
FEW_ROWS_WIDE_CONFIG = Int4GemmConfig(256, 128, 16, 3)
MANY_ROWS_CONFIG = Int4GemmConfig(128, 128, 8, 4)


def dequantize_asm(dtype: torch.dtype) -> str:
    """The PTX that turns two words a ($8), b ($9) of one column, with that column's scale pair
    ($10) and negated scaled zero pair ($11), into their 8 rows of weights: $i = (row i of b) << 16
    | (row i of a), each q * s - z in 16 bits. prmt gathers the low (rows 0-3) and the high (rows
    4-7) halves of both words; per row a shift and a lop3, (t & 0x000F000F) | MAGIC, make the pair
    OFFSET + q (int4_gemv.unpack_asm); sub removes OFFSET exactly and fma scales, rounding once."""
    magic_bits, _ = MAGIC[dtype]
    kind = "bf16x2" if dtype == torch.bfloat16 else "f16x2"
    magic = f"{magic_bits * 0x10001:#010x}"
    lines = ["prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;", f"mov.b32 m, {magic};"]
    for i in range(8):
        half, shift = ("lo", "hi")[i // 4], 4 * (i % 4)
        source = half
        if shift:
            lines.append(f"shr.u32 t, {half}, {shift};")
            source = "t"
        lines.append(f"lop3.b32 t, {source}, 0x000F000F, {magic}, 0xEA;")
        lines.append(f"sub.rn.{kind} t, t, m;")
        lines.append(f"fma.rn.{kind} ${i}, t, $10, $11;")
    return "{\n.reg .b32 lo, hi, t, m;\n" + "\n".join(lines) + "\n}"


@triton.jit
def _dequantize_row(words, s, neg_z, I: tl.constexpr, DTYPE: tl.constexpr):
    """Row I of each word as weights q * s - z in DTYPE, by integer and float32 math (the interpreter's path)."""
    q = ((words >> (4 * I)) & 0xF).to(tl.float32)
    return (q * s.to(tl.float32) + neg_z.to(tl.float32)).to(DTYPE)


@triton.jit
def _dequantize_rows(words, s, neg_z, ASM: tl.constexpr, USE_PTX: tl.constexpr, DTYPE: tl.constexpr):
    """The 8 rows of each word as weights in DTYPE (s and neg_z broadcast to the words' shape)."""
    if USE_PTX:
        rows = tl.inline_asm_elementwise(
            asm=ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", args=[words, s, neg_z],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16),
            is_pure=True, pack=2)
        return bitcast_rows(rows, DTYPE)
    else:
        return (_dequantize_row(words, s, neg_z, 0, DTYPE), _dequantize_row(words, s, neg_z, 1, DTYPE),
                _dequantize_row(words, s, neg_z, 2, DTYPE), _dequantize_row(words, s, neg_z, 3, DTYPE),
                _dequantize_row(words, s, neg_z, 4, DTYPE), _dequantize_row(words, s, neg_z, 5, DTYPE),
                _dequantize_row(words, s, neg_z, 6, DTYPE), _dequantize_row(words, s, neg_z, 7, DTYPE))


@triton.jit(do_not_specialize=["M", "NUM_SPLITS"])   # one compiled kernel for every row and split count
def _int4_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, partial_ptr, arrivals_ptr,
                      M, N, K, K_PER_SPLIT, NUM_SPLITS,
                      GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                      ASM: tl.constexpr, USE_PTX: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    WORDS: tl.constexpr = 16
    STEP: tl.constexpr = 128
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)   # row tiles of one column tile run together: one weight read
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    dtype = x_ptr.dtype.element_ty
    slab = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)     # out^T
    k_start = tl.program_id(2) * K_PER_SPLIT
    for k0 in tl.range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), STEP, num_stages=NUM_STAGES):
        kw = k0 // 8 + slab
        words = tl.load(qweight_ptr + kw[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0)
        group = k0 // GROUP_SIZE
        s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0)
        neg_z = -tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0)
        w = _dequantize_rows(words, tl.broadcast_to(s[None, :], (WORDS, BLOCK_N)),
                             tl.broadcast_to(neg_z[None, :], (WORDS, BLOCK_N)), ASM, USE_PTX, dtype)
        # the step's weights as one [STEP, BLOCK_N] tile, row 16i + r holding input row 8r + i (joins
        # and reshapes only rename registers: no data moves)
        pairs = (tl.join(w[0], w[1]), tl.join(w[2], w[3]), tl.join(w[4], w[5]), tl.join(w[6], w[7]))
        quads = (tl.join(pairs[0], pairs[1]), tl.join(pairs[2], pairs[3]))
        tile = tl.reshape(tl.permute(tl.join(quads[0], quads[1]), (4, 3, 2, 0, 1)), (STEP, BLOCK_N))
        # x interleaved to match: its columns 16i + r of this step are x's 8r + i
        x = tl.load(x_ptr + rows[:, None] * K + (k0 + tl.arange(0, STEP))[None, :], mask=row_ok[:, None], other=0.0)
        acc = tl.dot(tl.trans(tile), tl.trans(x), acc, input_precision=INPUT_PRECISION)
    offsets = rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        # the splits of a tile add into float32 sums in a workspace; the last to arrive writes the
        # output and leaves the sums and its arrival count at zero for the next call (as int4_gemv)
        tl.atomic_add(partial_ptr + offsets, tl.trans(acc), mask=mask, sem="relaxed")
        tl.debug_barrier()     # every thread's sums are in before the tile counts this program as arrived
        arrivals = arrivals_ptr + pid_n * tl.num_programs(0) + pid_m
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == NUM_SPLITS - 1:
            total = tl.load(partial_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(partial_ptr + offsets, tl.zeros_like(total), mask=mask)
            tl.store(arrivals, 0)
    else:
        tl.store(out_ptr + offsets, tl.trans(acc).to(out_ptr.dtype.element_ty), mask=mask)


def interleave_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> the copy int4_gemm reads: in each run of 128 columns, column 8r + i moved to 16i + r."""
    m, k = x.shape
    return x.reshape(m, k // STEP, STEP // 8, 8).transpose(2, 3).reshape(m, k)


@triton.jit
def _interleave_kernel(x_ptr, out_ptr, M, K, BLOCK_M: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * (STEPS * 128) + tl.arange(0, STEPS * 128)
    offsets = rows[:, None] * K + cols[None, :]
    mask = (rows < M)[:, None]
    x = tl.reshape(tl.load(x_ptr + offsets, mask=mask), (BLOCK_M, STEPS, 16, 8))
    tl.store(out_ptr + offsets, tl.reshape(tl.permute(x, (0, 1, 3, 2)), (BLOCK_M, STEPS * 128)), mask=mask)


def interleave_rows(x: torch.Tensor) -> torch.Tensor:
    """interleave_rows_ref in one kernel, 8 rows by 512 columns a program: on an H200, 240 rows of
    4,096 (12,288) columns in 1.6 (2.5) us, where torch's strided copy took 3.6 (7.4)."""
    m, k = x.shape
    out = torch.empty_like(x)
    steps = 4 if k % (4 * STEP) == 0 else 1
    if m:
        _interleave_kernel[(triton.cdiv(m, 8), k // (steps * STEP))](x, out, m, k, BLOCK_M=8, STEPS=steps,
                                                                      **pdl_launch(x))
    return out


def gemm_supported(k: int, group_size: int, g_idx: torch.Tensor | None, bits: int) -> bool:
    """Whether int4_gemm takes this layer: 4 bits, groups that are runs of at least 128 rows dividing K."""
    return bits == 4 and g_idx is None and group_size % STEP == 0 and k % group_size == 0


def launch_for(m: int, n: int, k: int) -> tuple[Int4GemmConfig, int]:
    """The tile and the K split for an [m, k] @ [k, n] product."""
    if m <= 128:
        if n >= 4 * k:
            return FEW_ROWS_WIDE_CONFIG, 1
        if k >= 2 * n:
            return MANY_ROWS_CONFIG, 4
        return FEW_ROWS_CONFIG, 2
    return MANY_ROWS_CONFIG, 2 if k >= n else 1


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
    split_k = max(1, min(split_k or chosen_split, k // STEP))
    k_per_split = triton.cdiv(k // STEP, split_k) * STEP
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    use_ptx = x.is_cuda and x.dtype in MAGIC
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    if split_k > 1:   # float32 sums and arrival counts, zero between calls (the kernel leaves them so)
        partial = zeroed_workspace(x.device, torch.float32, m * n)
        arrivals = zeroed_workspace(x.device, torch.int32, grid[0] * grid[1])
    else:
        partial = arrivals = out   # unused
    _int4_gemm_kernel[grid](interleave_rows(x), qweight, scales, scaled_zeros, out, partial, arrivals, m, n, k,
                            k_per_split, split_k, GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_M=block_m,
                            SPLIT=split_k > 1, ASM=dequantize_asm(x.dtype) if use_ptx else "", USE_PTX=use_ptx,
                            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                            NUM_STAGES=num_stages, num_warps=num_warps)
    return out
