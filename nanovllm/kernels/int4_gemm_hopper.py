"""int4_gemm's product for 2 rows and more on Hopper, written in Gluon: Triton's lower layer, where
the program itself places the loads, the products and the waits that tl.dot's pipelining places.

The same arithmetic as int4_gemm.py (two packed words of a column dequantized to 16 weights by its
`dequantize_asm`, the weight tile the matrix cores' register operand, out^T = W^T x^T, x read as it
is thanks to int_gemm's step order), scheduled differently: x and the packed words of each 128-row
step come by TMA into a ring of STAGES buffers, each signalled by an mbarrier; a step's two products
(rows 0-3 of the words, then 4-7) add into one set of float32 sums and the program waits after each
product until one is left in flight, so one half is dequantized while the other multiplies. The last
product is retired inside the loop, not after it: there ptxas moved the epilogue's reads of the sums
above the wait.

The x tile follows the rows (rows_tile): 8, 16, 32 or 64 rows with K split to a few programs an SM;
from 65 rows 128 x 128 tiles of two warp groups; at 129-160 rows one 128-row piece and a 32-row one,
both multiplied by each dequantized weight tile; past 160, 256-row tiles where each program keeps
WIDE_MIN_STEPS steps of K. From 65 rows the programs run whole tiles in full waves and split only
the last wave's tiles (balanced_split). One row stays int4_gemv's (a hair faster there). What each
choice bought, per projection and row count: docs/benchmarks.md ("Quantized weights") and
benchmarks.json.

Gluon runs only compiled, so there is no interpreter path: the twin is int_gemm's `int_gemm_ref`,
checked on the GPU, and the build for sm_90a is checked without one.
"""
import torch

from nanovllm.kernels.int4_gemm import dequantize_asm, gemm_supported, k_splits
from nanovllm.kernels.fp8_gemv import sm_count
from nanovllm.kernels.int_gemm import STEP
from nanovllm.kernels.hopper_split_tiles import HAS_GLUON, balanced_split, split_workspace
from nanovllm.kernels.triton_compat import cuda_major_capability, triton

if HAS_GLUON:
    from nanovllm.kernels.hopper_split_tiles import (TensorDescriptor, drained, gl, gluon, leave_tile, mbarrier,
                                                     program_tile, ready_barriers, retire_step, tma_load, warpgroup_mma,
                                                     warpgroup_mma_wait)

BLOCK_N, BLOCK_M, STAGES, NUM_WARPS = 128, 128, 4, 8
# Up to 64 rows the x tile is the rows rounded up to 8, 16, 32 or 64 (the products as wide), K split
# until about this many programs per SM: the best split of each 8B projection on one H200, or within
# 4% (docstring); from 65 rows 128-row tiles, one program an SM, scheduled by balanced_split
FEW_ROWS_MAX, FEW_ROWS_PROGRAMS_PER_SM = 16, 3
SMALL_TILE_MAX, SMALL_TILE_PROGRAMS_PER_SM = 64, 2
# 129-160 rows take one x tile of a 128-row piece and a 32-row one, so the products are as wide as
# the rows need and each weight is dequantized once, not once per 128-row tile. (64 + 32 at 65-96
# rows and 128 + 64 at 161-192 did not pay: docs/benchmarks.md.)
EXTRA_ROWS = 32
# Past 128 + EXTRA_ROWS rows, x tiles of 256 rows (the widest product), each weight dequantized once,
# where each program still runs WIDE_MIN_STEPS steps of K (8B on an H200, x36 at 192 rows: gate_up
# 85.0 / down 45.4 against 96.1 / 51.2 us in 128-row tiles; o, split in 4, 24.4 against 22.9); the
# x buffers take the shared memory of WIDE_STAGES steps
WIDE_ROWS, WIDE_STAGES, WIDE_MIN_STEPS = 256, 3, 24


def rows_tile(m: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """The x tile for an [m, k] @ [k, n] product on `sms` SMs: the rows of its main piece and of a
    second, narrower one (or 0)."""
    if m <= SMALL_TILE_MAX:
        return next(tile for tile in (8, 16, 32, 64) if m <= tile), 0
    if m <= BLOCK_M + EXTRA_ROWS:
        return BLOCK_M, EXTRA_ROWS if m > BLOCK_M else 0
    return (WIDE_ROWS, 0) if wide_tile_pays(m, n, k, sms) else (BLOCK_M, 0)


def wide_tile_pays(m: int, n: int, k: int, sms: int) -> bool:
    """Whether 256-row tiles leave each program WIDE_MIN_STEPS steps of K once balanced_split has
    split them to fill the SMs (below that the split sums cost more than dequantizing once saves)."""
    k_steps = k // STEP
    whole, splits = balanced_split(triton.cdiv(m, WIDE_ROWS) * triton.cdiv(n, BLOCK_N), k_steps, sms)
    return (k_steps if whole else k_steps // splits) >= WIDE_MIN_STEPS


def schedule(m: int, k: int, tiles: int, sms: int) -> tuple[int, int]:
    """(whole-K tiles, K splits of the others) for m rows and K = k in `tiles` of rows_tile's tiles
    on `sms` SMs (up to 64 rows one row of tiles, split to about per_sm programs an SM)."""
    if m > SMALL_TILE_MAX:
        return balanced_split(tiles, k // STEP, sms)
    per_sm = FEW_ROWS_PROGRAMS_PER_SM if m <= FEW_ROWS_MAX else SMALL_TILE_PROGRAMS_PER_SM
    return 0, max(1, round(per_sm * sms / tiles))


def takes(x: torch.Tensor) -> bool:
    """Whether int4_gemm_hopper multiplies these rows: 16-bit, on a Hopper GPU, two or more (one row
    is int4_gemv's), at an address TMA can read (16-byte aligned)."""
    return HAS_GLUON and x.shape[0] >= 2 and x.dtype in (torch.bfloat16, torch.float16) \
        and cuda_major_capability(x) == 9 and x.data_ptr() % 16 == 0


if HAS_GLUON:
    @gluon.jit
    def _dequantize(words, s, neg_z, ASM: gl.constexpr, LAYOUT: gl.constexpr):
        """Four rows of each word (dequantize_asm) joined into the [BLOCK_N, 64] register operand whose
        column 16i + r is word r's row i (joins, permutes and reshapes that rename registers)."""
        rows = gl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,=r,=r,r,r,r,r", args=[words, s, neg_z],
                                         dtype=(gl.int16, gl.int16, gl.int16, gl.int16), is_pure=True, pack=2)
        dtype: gl.constexpr = s.dtype
        quad = gl.join(gl.join(rows[0].to(dtype, bitcast=True), rows[1].to(dtype, bitcast=True)),
                       gl.join(rows[2].to(dtype, bitcast=True), rows[3].to(dtype, bitcast=True)))
        tile = gl.reshape(gl.permute(quad, (3, 2, 0, 1)), (4 * words.shape[0], words.shape[1]))
        return gl.convert_layout(gl.permute(tile, (1, 0)), LAYOUT)

    @gluon.jit
    def _load_step(step, k_start, off_m, off_n, x_desc, x2_desc, w_desc, x_smem, x2_smem, w_smem, ready,
                   STAGES: gl.constexpr, EXTRA_M: gl.constexpr):
        """TMA of one step's packed words and the two halves of each x piece into buffer step % STAGES."""
        stage = step % STAGES
        k0 = k_start + step * 128
        nbytes: gl.constexpr = 2 * x_desc.block_type.nbytes + w_desc.block_type.nbytes \
            + (2 * x2_desc.block_type.nbytes if EXTRA_M > 0 else 0)
        mbarrier.expect(ready.index(stage), nbytes)
        tma_load(w_desc, [k0 // 8, off_n], ready.index(stage), w_smem.index(stage))
        tma_load(x_desc, [off_m, k0], ready.index(stage), x_smem.index(2 * stage))
        tma_load(x_desc, [off_m, k0 + 64], ready.index(stage), x_smem.index(2 * stage + 1))
        if EXTRA_M > 0:
            off_m2 = off_m + x_desc.block_type.shape[0]
            tma_load(x2_desc, [off_m2, k0], ready.index(stage), x2_smem.index(2 * stage))
            tma_load(x2_desc, [off_m2, k0 + 64], ready.index(stage), x2_smem.index(2 * stage + 1))

    @gluon.jit
    def _int4_gemm_hopper_kernel(x_desc, x2_desc, w_desc, scales_ptr, zeros_ptr, out_ptr, partial_ptr,
                                 arrivals_ptr, M, N, K, K_PER_SPLIT, M_TILES, WHOLE_TILES, TAIL_SPLITS,
                                 GROUP_SIZE: gl.constexpr,
                                 BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, EXTRA_M: gl.constexpr,
                                 STAGES: gl.constexpr, SPLIT: gl.constexpr, ASM_LOW: gl.constexpr,
                                 ASM_HIGH: gl.constexpr, num_warps: gl.constexpr):
        sums_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, BLOCK_M, 16])
        weight_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=sums_layout, k_width=2)
        # each thread holds words r, r + 1 (one dequantize_asm call) of columns c and c + 8, rows r + 8
        # and r + 9 too, warp w columns 16w to 16w + 15 (128 columns, 8 warps): after _dequantize, the
        # registers the matrix cores take for those weights
        words_layout: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [0, 8], [8, 0]], lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=[[0, 16], [0, 32], [0, 64]], block_bases=[], shape=[16, BLOCK_N])
        dtype: gl.constexpr = x_desc.dtype
        tile, pid_m, pid_n, k_start, steps, split = program_tile(K, K_PER_SPLIT, M_TILES, WHOLE_TILES, TAIL_SPLITS, 128)
        off_m, off_n = pid_m * (BLOCK_M + EXTRA_M), pid_n * BLOCK_N

        x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        if EXTRA_M > 0:
            x2_smem = gl.allocate_shared_memory(dtype, [2 * STAGES] + x2_desc.block_type.shape, x2_desc.layout)
        else:
            x2_smem = x_smem
        ready = ready_barriers(STAGES)
        for i in gl.static_range(STAGES - 1):
            if i < steps:
                _load_step(i, k_start, off_m, off_n, x_desc, x2_desc, w_desc, x_smem, x2_smem, w_smem, ready, STAGES,
                           EXTRA_M)

        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, words_layout))
        col_ok = cols < N
        group = k_start // GROUP_SIZE
        s_next = gl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0)
        z_next = gl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0)
        sums = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=sums_layout)
        if EXTRA_M > 0:
            sums2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                   instr_shape=[16, EXTRA_M, 16])
            sums2 = gl.zeros([BLOCK_N, EXTRA_M], gl.float32, layout=sums2_layout)
        else:
            sums2 = sums        # a placeholder: no second piece
        high = gl.zeros([BLOCK_N, 64], dtype, layout=weight_layout)
        for step in range(steps):
            stage = step % STAGES
            s_now, z_now = s_next, z_next
            if step + 1 < steps:     # the next step's scales load while this one computes
                group = (k_start + (step + 1) * 128) // GROUP_SIZE
                s_next = gl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0)
                z_next = gl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0.0)
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            words = w_smem.index(stage).load(words_layout)
            s, _ = gl.broadcast(gl.expand_dims(s_now, 0), words)
            neg_z, _ = gl.broadcast(gl.expand_dims(-z_now, 0), words)
            # a product's register operand stays alive until the wait that retires the product
            # (the second piece's products ride along: they are waited for with the first's)
            low = _dequantize(words, s, neg_z, ASM_LOW, weight_layout)
            sums = warpgroup_mma(low, x_smem.index(2 * stage).permute((1, 0)), sums, is_async=True)
            if EXTRA_M > 0:
                sums2 = warpgroup_mma(low, x2_smem.index(2 * stage).permute((1, 0)), sums2, is_async=True)
                sums, sums2, high = warpgroup_mma_wait(num_outstanding=2, deps=(sums, sums2, high))
            else:
                sums, high = warpgroup_mma_wait(num_outstanding=1, deps=(sums, high))
            high = _dequantize(words, s, neg_z, ASM_HIGH, weight_layout)
            sums = warpgroup_mma(high, x_smem.index(2 * stage + 1).permute((1, 0)), sums, is_async=True)
            if EXTRA_M > 0:
                sums2 = warpgroup_mma(high, x2_smem.index(2 * stage + 1).permute((1, 0)), sums2, is_async=True)
                sums, sums2, low = warpgroup_mma_wait(num_outstanding=2, deps=(sums, sums2, low))
            else:
                sums, low = warpgroup_mma_wait(num_outstanding=1, deps=(sums, low))
            retire_step(step, steps, sums, sums2, EXTRA_M)
            if step + STAGES - 1 < steps:
                _load_step(step + STAGES - 1, k_start, off_m, off_n, x_desc, x2_desc, w_desc, x_smem, x2_smem, w_smem,
                           ready, STAGES, EXTRA_M)
        sums, sums2 = drained(sums, sums2, ready, STAGES, EXTRA_M)
        leave_tile(sums, sums2, tile, off_m, off_n, M, N, out_ptr, partial_ptr, arrivals_ptr, SPLIT, split, TAIL_SPLITS,
                   BLOCK_N, BLOCK_M, EXTRA_M, num_warps)


def x_shared_layout(dtype: torch.dtype, rows: int):
    """The TMA buffer layout of an x piece: its rows of 64 as the matrix cores read them (128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([rows, 64], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def words_shared_layout():
    """The TMA buffer layout of the packed words: plain (their rows are 512 bytes, wider than any swizzle)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def int4_gemm_hopper(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
                     group_size: int, split_k: int | None = None) -> torch.Tensor:
    """int4_gemm on a Hopper GPU (takes(x)): x [M, K] 16-bit @ the 4-bit packed weight -> [M, N]."""
    m, k = x.shape
    n = qweight.shape[1]
    if not gemm_supported(k, group_size, None, 4) or qweight.shape[0] * 8 != k:
        raise ValueError(f"int4_gemm_hopper: needs groups of a multiple of {STEP} rows dividing K = {k} and "
                         f"{k // 8} packed rows; got group_size {group_size}, {qweight.shape[0]} packed rows")
    sms = sm_count(x.device)
    block_m, extra_m = rows_tile(m, n, k, sms)
    m_tiles = triton.cdiv(m, block_m + extra_m)
    tiles = m_tiles * triton.cdiv(n, BLOCK_N)
    whole_tiles, split_k = (0, split_k) if split_k else schedule(m, k, tiles, sms)
    k_per_split, split_k = k_splits(k, split_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    programs = whole_tiles + (tiles - whole_tiles) * split_k
    partial, arrivals = split_workspace(out, tiles, split_k > 1)
    def x_piece(rows: int) -> TensorDescriptor:
        return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, 64], x_shared_layout(x.dtype, rows))
    x_desc = x_piece(block_m)
    x2_desc = x_piece(extra_m) if extra_m else x_desc   # the kernel reads it only for a second piece
    w_desc = TensorDescriptor(qweight, list(qweight.shape), list(qweight.stride()), [16, BLOCK_N],
                              words_shared_layout())
    _int4_gemm_hopper_kernel[(programs,)](x_desc, x2_desc, w_desc, scales, scaled_zeros, out, partial, arrivals, m, n,
                                          k, k_per_split, m_tiles, whole_tiles, split_k, GROUP_SIZE=group_size,
                                          BLOCK_N=BLOCK_N, BLOCK_M=block_m, EXTRA_M=extra_m,
                                          STAGES=WIDE_STAGES if block_m == WIDE_ROWS else STAGES, SPLIT=split_k > 1,
                                          ASM_LOW=dequantize_asm(x.dtype, 0), ASM_HIGH=dequantize_asm(x.dtype, 4),
                                          num_warps=NUM_WARPS)
    return out
