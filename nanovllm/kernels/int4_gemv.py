"""Few-row products with 4-bit weights in int_gemm's layout (AWQ and GPTQ after loading):
y = x @ W, W[k, n] = q[k, n] * scales[g, n] - scaled_zeros[g, n], g = k // group_size.

At decode the weight bytes are the whole cost, so a step must spend about one instruction per
weight. Each program streams BLOCK_N packed columns (16-byte loads along the output features) over
a run of input rows; K is split over programs when the columns alone leave too few programs to fill
the GPU: their float32 partial sums meet by atomic adds in a workspace, and the last program of a
tile to arrive writes the output (one kernel per product, no zeroing or casting kernels around it).
The layout packs a step of 128 input rows at a time (int_gemm's step order: word r holds rows 16i + r
in bits [4i, 4i + 4)). Two packed words a, b become 16 weights in 16
instructions: two `prmt` gather their low and their high halves, then per row i a shift and one
`lop3`, (t >> 4i) & 0x000F000F | MAGIC, make the pair of 16-bit floats OFFSET + q (row i of a, row
i of b), since MAGIC's halves are the float OFFSET (bfloat16 0x4300 = 128, float16 0x6400 = 1024)
whose low mantissa bits are then q; the pair is the register the matrix cores take. These integers
are exact in 16 bits, so with x_i the columns 16i + r of x (one load of 16 contiguous columns per
i), raw = sum_i x_i @ (OFFSET + q_i) over the step's words, summed in float32; a step lies
inside one group, so the scale and zero are applied once per step and column:
    sum_k x[k] W[k, n] = s[n] raw[n] - (OFFSET s[n] + z[n]) sum_k x[k],
the step's sum of x taken by the matrix cores too (x_i @ ones: it lands in the accumulator's layout,
and the compiler keeps one column tile of it, the others being equal).
Rows are padded to a 16-row tile (the matrix cores' smallest).
One row (batch-1 decode) would waste 15 of those 16 rows, so it multiplies element-wise in float32
instead: each word becomes its 8 rows as float32 offset + q in 11 instructions (unpack_f32_asm: a
shift per two rows, even rows under 128, odd under 2048, and a lop3 per row), one fused multiply-add
each with x_i, and per step the scale and zero (with the offsets' share of x) once per word and column.
Triton's CPU interpreter runs no inline PTX: there the same values come from integer shifts and
masks (both PTX programs are checked by an emulation of their instructions in tests/test_int4_gemv.py). Act-order
layers (a g_idx) and 8 bits stay on int_gemm. The torch twin is int_gemm's: `int_gemm_ref`.
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.fp8_gemv import sm_count, split_k_for
from nanovllm.kernels.int_gemm import in_step_order
from nanovllm.kernels.silu_epilogue import gated_columns, silu_and_mul_store
from nanovllm.kernels.triton_compat import pdl_launch, tl, triton, wait_for_previous_kernel
from nanovllm.kernels.zeroed_workspace import PendingSums, last_to_arrive, zeroed_workspace

# The weight-only linear sends 4-bit products of at most this many rows here on CUDA (more to
# int4_gemm, then int_dequantize; on Hopper only one row: more go to int4_gemm_hopper). Measured
# with `scripts/int_gemm_bench.py --int4-gemv` (Qwen3-8B projections of 36 layers,
# docs/benchmarks.md): on one H100 2.82 ms (the 16-row tile; element-wise now 2.15) against
# int_gemm's 4.46 at one row, 4.11 against 4.69 at 16. From 17 rows int4_gemm is
# faster (one H200, one call, 2026-12-02: x36 3.74 / 3.75 ms at 24 / 32 rows against 3.93 / 4.00 here
# in the 32-row tiles it had then, bf16 3.91 / 3.95; AWQ TPOT at batch 24 / 32 5.064 / 5.119 ms
# through this GEMV, 4.824 / 4.892 through int4_gemm); at 16 rows this GEMV's 2.60 ms beats its 3.71.
GEMV_MAX_ROWS = 16

# The 16-bit float whose halves the unpacking writes q into: bit pattern and value, by activation dtype.
MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
# float32 (the interpreter only): the offset is added to the integer, then converted
INTERPRETER_OFFSET = 128.0   # bfloat16's, at float32 precision


class Int4GemvConfig(NamedTuple):
    block_n: int        # packed columns per program
    block_k: int        # input rows per loop step (8 per word; at least 128: 16 words, the matrix cores' K)
    num_warps: int
    num_stages: int
    sub_words: int = 16     # one row: words per sub-step (the rows of a tile each lane holds)
    block_m: int = 16       # rows per program above one row (the matrix cores' smallest tile: 16);
                            # larger tiles unpack each weight once for more rows


# 2-16 rows: 128 columns x 16 words a step, four stages. In step order (one H100, 2026-12-02,
# `scripts/int_gemm_bench.py --int4-gemv --sweep --batch 8 16`) the best launch of every projection
# or within 2% (gate_up, down, o at 8 rows 32.4, 18.1, 9.8 us against 35.4, 22.3, 11.2 for 256 x 3 stages)
DEFAULT_CONFIG = Int4GemvConfig(128, 128, 4, 4)
# One row: programs of two warps, 256 columns, sub-steps of 8 words (each lane 8 words of 4
# columns a load). On one H200 (2026-12-03, Qwen3-8B projections,
# `scripts/int_gemm_bench.py --int4-gemv --sweep --batch 1`) the best of 13 launch shapes x 6 splits
# or within 0.2 us; AWQ batch 1 2.49 against 2.67 ms for single-warp programs of 64 or 128 columns
# in sub-steps of 2 words, which an H100 sweep had chosen.
ONE_ROW_CONFIG = Int4GemvConfig(256, 128, 2, 1, sub_words=8)
# Layers of at least WIDE_ONE_ROW_MIN_WEIGHTS take 512 columns in sub-steps of 4 words: each lane
# then holds 8 columns, so the x values it converts and sums serve twice the weights (3.0
# instructions a weight against 3.8 in the sm_90a SASS). On one H200 (2026-12-03, loads still masked)
# gate_up and down 19.7 / 11.1 us against 22.9 / 13.4 (AWQ batch 1 2.455 against 2.496 ms); qkv and o
# (25M and 17M weights) lost, 8.4 / 7.6 against 7.3 / 6.3 us.
WIDE_ONE_ROW_CONFIG = Int4GemvConfig(512, 128, 2, 1, sub_words=4)
WIDE_ONE_ROW_MIN_WEIGHTS = 40 << 20
# One row splits K until about this many warps per SM stream the weight (the best split of each
# projection in that sweep)
ONE_ROW_WARPS_PER_SM = 24
# Below this many weights a layer's K and N leave the element-wise programs too few warps, and one
# row takes the 16-row tile too: on one H100 the element-wise path won from 15M weights (Qwen3-4B's
# qkv_proj) up and lost or tied at 12M and below (Qwen3-0.6B and 1.7B projections, docs/benchmarks.md)
ONE_ROW_MIN_WEIGHTS = 14 << 20


def gemv_supported(k: int, group_size: int, g_idx: torch.Tensor | None, bits: int,
                   config: Int4GemvConfig | None = None) -> bool:
    """Whether int4_gemv takes this layer: packed in step order (int_gemm.in_step_order), whole loop steps per group."""
    block_k = (config or DEFAULT_CONFIG).block_k
    return in_step_order(k, bits, group_size, g_idx is not None) and group_size % min(block_k, group_size) == 0


def unpack_asm(magic_bits: int) -> str:
    """The PTX that turns two words a ($8), b ($9) into their 8 rows, $i = (row i of b) << 16 | (row i of a)
    as 16-bit floats OFFSET + q: prmt gathers their low (rows 0-3) and high (rows 4-7) halves into
    one register each (selectors 0x5410, 0x7632), then per row a shift and one lop3,
    (t & 0x000F000F) | MAGIC (lookup table 0xEA = (0xF0 & 0xCC) | 0xAA). The pair is the matrix
    cores' operand register."""
    lines = ["prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for i in range(8):
        half, shift = ("lo", "hi")[i // 4], 4 * (i % 4)
        if shift:
            lines.append(f"shr.u32 t, {half}, {shift};")
        lines.append(f"lop3.b32 ${i}, {'t' if shift else half}, 0x000F000F, {magic_bits * 0x10001:#010x}, 0xEA;")
    return "{\n.reg .b32 lo, hi, t;\n" + "\n".join(lines) + "\n}"



# One row unpacks straight to float32: a nibble in bits 16-19 under the exponent of 128.0, whose
# float32 ulp there is 1, reads as 128 + q; one in bits 12-15 under 2048.0 as 2048 + q. So one shift
# places two rows (even rows under 128, odd rows under 2048). The odd rows' sums run 16 times higher,
# so float32 keeps 4 bits fewer of them: errors about a tenth of a bfloat16 rounding (tests/test_int4_gemv.py).
F32_MAGIC = {128.0: 0x43000000, 2048.0: 0x45000000}
F32_ROW_OFFSETS = (128.0, 2048.0) * 4       # by row: even rows, odd rows
# the rows each shift of the word places (bits 16-19, bits 12-15), and the PTX of the shift
F32_SHIFTS = (((4, 3), None), ((2, 1), "shl.b32 t, $8, 8;"), ((6, 5), "shr.b32 t, $8, 8;"),
              ((0, 7), "prmt.b32 t, $8, $8, 0x1032;"))      # prmt: the halves swapped, a rotation by 16


def unpack_f32_asm() -> str:
    """The PTX that turns one word ($8) into its 8 rows as float32 offset + q ($0-$7; F32_ROW_OFFSETS):
    per pair of rows one shift (none for rows 4 and 3) and two lop3, (t & mask) | magic, 11
    instructions for 8 weights."""
    lines = []
    for (even, odd), shift in F32_SHIFTS:
        if shift:
            lines.append(shift)
        source = "t" if shift else "$8"
        lines.append(f"lop3.b32 ${even}, {source}, 0x000F0000, {F32_MAGIC[128.0]:#010x}, 0xEA;")
        lines.append(f"lop3.b32 ${odd}, {source}, 0x0000F000, {F32_MAGIC[2048.0]:#010x}, 0xEA;")
    return "{\n.reg .b32 t;\n" + "\n".join(lines) + "\n}"


@triton.jit
def _unpack_rows_f32(words, ASM: tl.constexpr, USE_PTX: tl.constexpr):
    """The 8 rows of each word as float32 tensors of offset + q (F32_ROW_OFFSETS: 128, 2048, 128, ...)."""
    if USE_PTX:
        return tl.inline_asm_elementwise(
            asm=ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[words],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    else:
        return (_row(words, 0, 0, 128.0, tl.float32), _row(words, 1, 0, 2048.0, tl.float32),
                _row(words, 2, 0, 128.0, tl.float32), _row(words, 3, 0, 2048.0, tl.float32),
                _row(words, 4, 0, 128.0, tl.float32), _row(words, 5, 0, 2048.0, tl.float32),
                _row(words, 6, 0, 128.0, tl.float32), _row(words, 7, 0, 2048.0, tl.float32))


@triton.jit
def bitcast_rows(rows, DTYPE: tl.constexpr):
    """The 8 int16 tensors an unpacking program writes, read as DTYPE."""
    return (rows[0].to(DTYPE, bitcast=True), rows[1].to(DTYPE, bitcast=True), rows[2].to(DTYPE, bitcast=True),
            rows[3].to(DTYPE, bitcast=True), rows[4].to(DTYPE, bitcast=True), rows[5].to(DTYPE, bitcast=True),
            rows[6].to(DTYPE, bitcast=True), rows[7].to(DTYPE, bitcast=True))


@triton.jit
def _unpack_rows(words, ASM: tl.constexpr, MAGIC_BITS: tl.constexpr, OFFSET: tl.constexpr, USE_PTX: tl.constexpr,
                 DTYPE: tl.constexpr):
    """The 8 rows of each word, row i as a tensor of OFFSET + q in DTYPE."""
    if USE_PTX:
        # two words per call (pack=2): 16 weights in 16 instructions (unpack_asm)
        rows = tl.inline_asm_elementwise(
            asm=ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[words],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16),
            is_pure=True, pack=2)
        return bitcast_rows(rows, DTYPE)
    else:
        return (_row(words, 0, MAGIC_BITS, OFFSET, DTYPE), _row(words, 1, MAGIC_BITS, OFFSET, DTYPE),
                _row(words, 2, MAGIC_BITS, OFFSET, DTYPE), _row(words, 3, MAGIC_BITS, OFFSET, DTYPE),
                _row(words, 4, MAGIC_BITS, OFFSET, DTYPE), _row(words, 5, MAGIC_BITS, OFFSET, DTYPE),
                _row(words, 6, MAGIC_BITS, OFFSET, DTYPE), _row(words, 7, MAGIC_BITS, OFFSET, DTYPE))


@triton.jit
def _row(words, I: tl.constexpr, MAGIC_BITS: tl.constexpr, OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """Row I of each word in integers (the interpreter's path): the bit pattern MAGIC | q where
    there is one (16-bit activations), else q + OFFSET converted (float32)."""
    q = (words >> (4 * I)) & 0xF
    if MAGIC_BITS:
        return (q | MAGIC_BITS).to(tl.int16).to(DTYPE, bitcast=True)
    return (q + OFFSET).to(DTYPE)


@triton.jit(do_not_specialize=["M", "NUM_SPLITS"])   # one compiled kernel for every row and split count
def _int4_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, partial_ptr, arrivals_ptr,
                      M, N, K, stride_x, K_PER_SPLIT, NUM_SPLITS,
                      GROUP_SIZE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      ASM: tl.constexpr, MAGIC_BITS: tl.constexpr, OFFSET: tl.constexpr, USE_PTX: tl.constexpr,
                      BLOCK_M: tl.constexpr, INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                      SUB_WORDS: tl.constexpr = 16, F32_ASM: tl.constexpr = "", GATED: tl.constexpr = False,
                      FINISH: tl.constexpr = True, EVEN_N: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if GATED:   # two runs of BLOCK_N // 2 contiguous columns: the loads stay 16 bytes wide
        cols, col_ok = gated_columns(pid_n, N // 2, BLOCK_N)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
    words_in_step = tl.arange(0, WORDS)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    dtype = x_ptr.dtype.element_ty
    if BLOCK_M == 1:
        # one row: element-wise float32 products per lane (a 16-row matrix-core tile would do 16
        # times the work), summed over the words once at the end. A step (one group or part of
        # one) goes in sub-steps of SUB_WORDS words: each lane then holds few rows of many columns,
        # and the x values it loads serve more columns.
        rows = pid_m + tl.arange(0, 1)
        sub = tl.arange(0, SUB_WORDS)
        x_row = x_ptr + pid_m * stride_x
        acc_words = tl.zeros((SUB_WORDS, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            raw = tl.zeros((SUB_WORDS, BLOCK_N), dtype=tl.float32)
            x_even = tl.zeros((SUB_WORDS,), dtype=tl.float32)     # the sums of x under each offset
            x_odd = tl.zeros((SUB_WORDS,), dtype=tl.float32)
            for j in tl.static_range(WORDS // SUB_WORDS):
                kw = k0 // 8 + j * SUB_WORDS + sub
                word_ptrs = qweight_ptr + kw.to(tl.int64)[:, None] * N + cols[None, :]
                if EVEN_N:  # whole column tiles load unmasked: the masked load zeroed its registers first and
                    # held 55 more (223 against 168 at 256 columns); AWQ batch 1 2.381 against 2.450 ms masked
                    words = tl.load(word_ptrs)
                else:
                    words = tl.load(word_ptrs, mask=col_ok[None, :], other=0)
                w = _unpack_rows_f32(words, F32_ASM, USE_PTX)
                for i in tl.static_range(8):
                    # word w of the step holds its rows 16i + w (k0 is a multiple of 128)
                    x_i = tl.load(x_row + k0 + ((j * SUB_WORDS) // 16) * 128 + (j * SUB_WORDS) % 16 + sub
                                  + 16 * i).to(tl.float32)
                    raw += x_i[:, None] * w[i]
                    if i % 2 == 0:
                        x_even += x_i
                    else:
                        x_odd += x_i
            group = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            x_offsets = 128.0 * x_even + 2048.0 * x_odd
            acc_words += s * (raw - x_offsets[:, None]) - z * (x_even + x_odd)[:, None]
        acc = tl.sum(acc_words, axis=0)[None, :]
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ones = tl.full((WORDS, BLOCK_N), 1.0, dtype)
        # row 0 of each word of a step: word w holds the step's rows 16i + w (steps start at multiples of 128)
        x_words = x_ptr + rows[:, None] * stride_x + ((words_in_step // 16) * 128 + words_in_step % 16)[None, :]
        for k0 in range(k_start, k_end, BLOCK_K):
            kw = k0 // 8 + words_in_step
            words = tl.load(qweight_ptr + kw.to(tl.int64)[:, None] * N + cols[None, :], mask=col_ok[None, :], other=0)
            raw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            x_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # the step's sum of x, in every column
            w = _unpack_rows(words, ASM, MAGIC_BITS, OFFSET, USE_PTX, dtype)
            for i in tl.static_range(8):
                x_i = tl.load(x_words + k0 + 16 * i, mask=row_ok[:, None], other=0.0)
                raw = tl.dot(x_i, w[i], raw, input_precision=INPUT_PRECISION)
                # summed by the matrix cores too: already in the accumulator's layout, no cross-lane reduction
                x_sum = tl.dot(x_i, ones, x_sum, input_precision=INPUT_PRECISION)
            group = k0 // GROUP_SIZE
            s = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc += s * raw                       # two fused multiply-adds per element
            acc -= (OFFSET * s + z) * x_sum
    offsets = rows[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & col_ok[None, :]
    if SPLIT:
        # the K splits of a tile add into float32 sums; the last to arrive writes the output and
        # leaves the sums and its arrival count at zero for the next call (no kernels around this one),
        # unless the next kernel finishes them (not FINISH: int4_gemv's leave_sums).
        # The adds are relaxed: the barrier and the arrival's release order them all before the
        # count, as one fence would (release or acq_rel adds fence each one).
        tl.atomic_add(partial_ptr + offsets, acc, mask=mask, sem="relaxed")
        if FINISH:
            arrivals = arrivals_ptr + pid_m * tl.num_programs(0) + pid_n
            if last_to_arrive(arrivals, NUM_SPLITS):
                # .cg: read from L2, where the other programs' adds were made
                total = tl.load(partial_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    silu_and_mul_store(out_ptr, total, rows, pid_n * (BLOCK_N // 2), M, N // 2, BLOCK_N)
                else:
                    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.debug_barrier()     # all read before any clears (the clearing may take another thread layout)
                tl.store(partial_ptr + offsets, tl.zeros_like(acc), mask=mask)
                tl.store(arrivals, 0)
    elif GATED:
        silu_and_mul_store(out_ptr, acc, rows, pid_n * (BLOCK_N // 2), M, N // 2, BLOCK_N)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
              group_size: int, config: Int4GemvConfig | None = None, split_k: int | None = None,
              gated: bool = False, leave_sums: bool = False) -> torch.Tensor | PendingSums:
    """x [M, K] (last dimension contiguous) @ the 4-bit packed weight -> [M, N] in x's dtype:
    bfloat16/float16 on CUDA (float32 too in the interpreter). Needs gemv_supported(K, group_size,
    None, 4, config); meant for M <= GEMV_MAX_ROWS (more rows run, config.block_m at a time).
    `int_gemm_ref` is the twin.
    gated: the weight is a merged [gate; up] matrix and the result silu(gate) * up [M, N // 2]
    (silu_epilogue.py).
    leave_sums: when K is split, return the float32 sums as PendingSums for the next kernel to
    finish and clear (the caller guarantees one does: rms_norm with a residual); the programs then
    only add, and none waits for the others (on an H100 the 8B shape's o_proj took 6.2 us this
    way against 7.7, down_proj 13.4 against 14.4)."""
    m, k = x.shape
    n = qweight.shape[1]
    one_row = m == 1 and k * n >= ONE_ROW_MIN_WEIGHTS
    if config is None and not one_row:
        config = DEFAULT_CONFIG
    elif config is None:
        config = WIDE_ONE_ROW_CONFIG if k * n >= WIDE_ONE_ROW_MIN_WEIGHTS else ONE_ROW_CONFIG
    block_n, block_k, num_warps, num_stages, sub_words, tile_rows = config
    if not gemv_supported(k, group_size, None, 4, config):
        raise ValueError(f"int4_gemv: group_size {group_size} must be at least 128, divide K = {k} and, when "
                         f"larger than block_k {block_k}, be a multiple of it; use int_gemm")
    if x.is_cuda and x.dtype not in MAGIC:
        raise TypeError(f"int4_gemv: x must be bfloat16 or float16 on CUDA, got {x.dtype}")
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"int4_gemv: qweight has {qweight.shape[0]} packed rows, K = {k} needs {k // 8}")
    block_k = min(block_k, group_size)
    magic_bits, offset = MAGIC.get(x.dtype, (0, INTERPRETER_OFFSET))
    assert not gated or n % 2 == 0      # then the n // 2 outputs take cdiv(n, block_n) programs too
    assert not (gated and leave_sums)
    column_programs = triton.cdiv(n, block_n)
    if split_k is None and one_row and x.is_cuda:
        split_k = round(ONE_ROW_WARPS_PER_SM * sm_count(x.device) / (column_programs * num_warps))
    split_k = max(1, min(split_k or split_k_for(x, column_programs, k, block_k), triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n // 2 if gated else n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 1 if one_row else tile_rows
    grid = (column_programs, split_k, triton.cdiv(m, block_m))
    if split_k > 1:   # float32 sums and arrival counts, zero between calls (the kernel leaves them so)
        partial = zeroed_workspace(x.device, torch.float32, max(m * n, 1 << 20))   # 4 MB: settles before graphs
        arrivals = zeroed_workspace(x.device, torch.int32, grid[0] * grid[2])
    else:
        partial = arrivals = out   # unused
    _int4_gemv_kernel[grid](x, qweight, scales, scaled_zeros, out, partial, arrivals, m, n, k, x.stride(0),
                            k_per_split, split_k, GROUP_SIZE=group_size, SPLIT=split_k > 1, BLOCK_N=block_n,
                            BLOCK_K=block_k, BLOCK_M=block_m,
                            ASM=unpack_asm(magic_bits), MAGIC_BITS=magic_bits, OFFSET=offset,
                            USE_PTX=x.is_cuda and x.dtype in MAGIC,
                            INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                            SUB_WORDS=min(sub_words, block_k // 8),
                            F32_ASM=unpack_f32_asm() if block_m == 1 else "", GATED=gated,
                            FINISH=not leave_sums, EVEN_N=n % block_n == 0, num_warps=num_warps,
                            num_stages=num_stages, **pdl_launch(x))
    if leave_sums and split_k > 1:
        return PendingSums(partial[:m * n].view(m, n), x.dtype)
    return out
