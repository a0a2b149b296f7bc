"""fp8_matmul's per-channel product for decode batches on Hopper, written in Gluon (Triton's lower
layer, where the program places its loads, products and waits itself): y = (x_q @ w_q^T) * x_s * w_s^T
(+ bias), x_q [M, K] and w_q [N, K] float8 e4m3, one float32 scale a token (x_s [M, 1]) and an
output feature (w_s [N, 1]).

Computed transposed, out^T = w_q @ x_q^T, so the weight's rows fill the matrix cores' tall side: a
tile is 64 features (one warp group's products) by the tokens (up to 128, or 128 + up to 64), or
past 192 tokens 128 features (two warp groups) by 128 tokens. Both operands come by TMA into a ring
of shared-memory buffers as deep as 192 KiB hold (six steps of 128 columns at 129-256 tokens), each
signalled by an mbarrier, and the float8 products (wgmma, both operands from shared memory, K-major)
keep one step in flight. The grid is one program an SM, scheduled as the 4-bit GEMM's
(hopper_split_tiles.balanced_split): whole tiles in full waves, only a last wave under half full
split in K (down_proj's 64 tiles in halves). The scales and the bias are applied to the float32 sums
before they leave (a split's share scaled alike, the bias added by the first split only).

Where it pays (Fp8LinearMethod.route: 129-256 tokens, each program keeping MIN_STEPS steps of K and,
past 192 tokens, the tiles in one wave), the 8B projections x36 on one H200 (2026-12-04) at 144 /
160 / 176 / 192 tokens take 3.14 / 3.11 / 3.27 / 3.25 ms against the Triton kernel's 3.28 / 3.36 /
3.78 / 3.82 (two-piece tiles, fp8_linear.py): qkv 12.1-13.0 us against 14.1-15.9, down 23.3-24.6
against 25.7-29.7, gate_up 39.2-41.9 against 39.4-48.8, o (two halves of 16 steps) 11.9 either way.
At 224 / 256 tokens qkv and down (WIDE_TILE_MIN_ROWS) save 1-5 us each; gate_up keeps cuBLASLt and
o the Triton kernel. At 96-128 tokens the Triton kernel stays as fast or faster (x36 at 96 / 128:
2.93 / 2.84 at best against 2.81 / 2.87). Gluon runs only compiled: the twin is fp8_linear's
`fp8_matmul_ref`, checked on the GPU, and the build for sm_90a is checked without one.
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.fp8_gemv import sm_count
from nanovllm.kernels.hopper_split_tiles import HAS_GLUON, balanced_split, split_workspace
from nanovllm.kernels.triton_compat import triton

if HAS_GLUON:
    from nanovllm.kernels.hopper_split_tiles import (TensorDescriptor, drained, gl, gluon, leave_tile, mbarrier,
                                                     program_tile, ready_barriers, retire_step, tma_load, warpgroup_mma,
                                                     warpgroup_mma_wait)

BLOCK_K = 128                   # 128 bytes of a float8 row a step (one 128-byte swizzle); 128 in the kernels
SHARED_BYTES = 192 * 1024       # the ring's buffers (a Hopper program gets at most 227 KiB)
MAX_STAGES = 6
# fewer steps of K a program and the split sums cost more than the filled SMs give (o_proj at 160 /
# 192 tokens, split in halves of 16 steps: 12.1 / 13.0 us against the Triton kernel's 11.9 / 11.8)
MIN_STEPS = 24
# Past this many tokens, tiles of 128 features by 128 tokens (two warp groups): a step's operands are
# 32 KiB for as many products as 64 features by 256 tokens get from 40. The 8B projections on one
# H200 (2026-12-04) at 224 / 256 tokens: down 25.7 / 26.6 us against 30.5-31.7 for 64 x 256 and the
# Triton kernel, qkv 14.2 / 14.2 against 15.0-16.1. At 129-192 tokens 64 features by 128 + the rest
# stay faster (128 x 128: x36 at 192 4.06 against 3.22 ms; 128 features by 128 + 64 at 160 / 192
# 3.73 / 4.13 against 3.12 / 3.28).
WIDE_TILE_MIN_ROWS = 193


class HopperFp8Tile(NamedTuple):
    block_m: int        # tokens of the tile's first piece
    extra_m: int = 0    # tokens of a second piece, multiplied by the same weight buffers
    block_n: int = 64   # features: 64 a warp group

    @property
    def num_warps(self) -> int:
        return self.block_n // 16

    @property
    def stages(self) -> int:
        step_bytes = (self.block_n + self.block_m + self.extra_m) * BLOCK_K
        return min(MAX_STAGES, SHARED_BYTES // step_bytes)


def hopper_tile(m: int) -> HopperFp8Tile:
    """The tile for m tokens: 64 features by pieces as wide as the tokens need, 128 x 128 past 192."""
    if m <= 128:
        return HopperFp8Tile(max(16, triton.next_power_of_2(m)))
    if m < WIDE_TILE_MIN_ROWS:
        return HopperFp8Tile(128, max(16, triton.next_power_of_2(m - 128)))
    return HopperFp8Tile(128, block_n=128)


def schedule(m: int, n: int, k: int, sms: int, tile: HopperFp8Tile | None = None) -> tuple[int, int, int]:
    """(tiles, tiles whose program runs K whole, the K splits of the others) for [m, k] @ [k, n]."""
    tile = tile or hopper_tile(m)
    tiles = triton.cdiv(m, tile.block_m + tile.extra_m) * triton.cdiv(n, tile.block_n)
    return tiles, *balanced_split(tiles, triton.cdiv(k, BLOCK_K), sms)


def pays(m: int, n: int, k: int, sms: int) -> bool:
    """Whether each program keeps MIN_STEPS steps of K once the grid is scheduled, and, in 128 x 128
    tiles, whether they fit one wave: over several (gate_up's 384 at 256 tokens) cuBLASLt's GEMM is
    as fast or faster (224 / 256 tokens 47.8 / 45.2 us against 50.4 / 46.0)."""
    tiles, _, splits = schedule(m, n, k, sms)
    return triton.cdiv(k, BLOCK_K) // splits >= MIN_STEPS and (m < WIDE_TILE_MIN_ROWS or tiles <= sms)


if HAS_GLUON:
    @gluon.jit
    def _load_step(step, k_start, off_m, off_n, x_desc, x2_desc, w_desc, x_smem, x2_smem, w_smem, ready,
                   STAGES: gl.constexpr, EXTRA_M: gl.constexpr):
        """TMA of one step's weight tile and x pieces into buffer step % STAGES."""
        stage = step % STAGES
        k0 = k_start + step * 128
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes \
            + (x2_desc.block_type.nbytes if EXTRA_M > 0 else 0)
        mbarrier.expect(ready.index(stage), nbytes)
        tma_load(w_desc, [off_n, k0], ready.index(stage), w_smem.index(stage))
        tma_load(x_desc, [off_m, k0], ready.index(stage), x_smem.index(stage))
        if EXTRA_M > 0:
            tma_load(x2_desc, [off_m + x_desc.block_type.shape[0], k0], ready.index(stage), x2_smem.index(stage))

    @gluon.jit
    def _scaled(sums, off_n, row0, k_start, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS: gl.constexpr):
        """out^T's sums [BLOCK_N, R] from row0 times each feature's and token's scale, plus the bias
        where this program's K range starts at 0."""
        cols = off_n + gl.arange(0, sums.shape[0], layout=gl.SliceLayout(1, sums.type.layout))
        rows = row0 + gl.arange(0, sums.shape[1], layout=gl.SliceLayout(0, sums.type.layout))
        w_s = gl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
        x_s = gl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
        sums = sums * gl.expand_dims(w_s, 1) * gl.expand_dims(x_s, 0)
        if HAS_BIAS:
            bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
            sums = sums + gl.expand_dims(bias * (k_start == 0).to(gl.float32), 1)
        return sums

    @gluon.jit
    def _fp8_gemm_hopper_kernel(x_desc, x2_desc, w_desc, x_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, partial_ptr,
                                arrivals_ptr, M, N, K, K_PER_SPLIT, M_TILES, WHOLE_TILES, TAIL_SPLITS,
                                HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                                EXTRA_M: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                                num_warps: gl.constexpr):
        sums_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                              instr_shape=[16, BLOCK_M, 32])
        tile, pid_m, pid_n, k_start, steps, split = program_tile(K, K_PER_SPLIT, M_TILES, WHOLE_TILES, TAIL_SPLITS,
                                                                 128)
        off_m, off_n = pid_m * (BLOCK_M + EXTRA_M), pid_n * BLOCK_N

        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        if EXTRA_M > 0:
            x2_smem = gl.allocate_shared_memory(x2_desc.dtype, [STAGES] + x2_desc.block_type.shape, x2_desc.layout)
        else:
            x2_smem = x_smem
        ready = ready_barriers(STAGES)
        for i in gl.static_range(STAGES - 1):
            if i < steps:
                _load_step(i, k_start, off_m, off_n, x_desc, x2_desc, w_desc, x_smem, x2_smem, w_smem, ready, STAGES,
                           EXTRA_M)

        sums = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=sums_layout)
        if EXTRA_M > 0:
            sums2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                                   instr_shape=[16, EXTRA_M, 32])
            sums2 = gl.zeros([BLOCK_N, EXTRA_M], gl.float32, layout=sums2_layout)
        else:
            sums2 = sums        # a placeholder: no second piece
        for step in range(steps):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            sums = warpgroup_mma(w_smem.index(stage), x_smem.index(stage).permute((1, 0)), sums, is_async=True)
            if EXTRA_M > 0:
                sums2 = warpgroup_mma(w_smem.index(stage), x2_smem.index(stage).permute((1, 0)), sums2, is_async=True)
                sums, sums2 = warpgroup_mma_wait(num_outstanding=2, deps=(sums, sums2))
            else:
                sums = warpgroup_mma_wait(num_outstanding=1, deps=(sums,))
            retire_step(step, steps, sums, sums2, EXTRA_M)
            if step + STAGES - 1 < steps:
                _load_step(step + STAGES - 1, k_start, off_m, off_n, x_desc, x2_desc, w_desc, x_smem, x2_smem, w_smem,
                           ready, STAGES, EXTRA_M)
        sums, sums2 = drained(sums, sums2, ready, STAGES, EXTRA_M)
        sums = _scaled(sums, off_n, off_m, k_start, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS)
        if EXTRA_M > 0:
            sums2 = _scaled(sums2, off_n, off_m + BLOCK_M, k_start, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, HAS_BIAS)
        leave_tile(sums, sums2, tile, off_m, off_n, M, N, out_ptr, partial_ptr, arrivals_ptr, SPLIT, split, TAIL_SPLITS,
                   BLOCK_N, BLOCK_M, EXTRA_M, num_warps)


def operand_layout(rows: int):
    """The TMA buffer layout of a float8 operand tile [rows, BLOCK_K]: as the matrix cores read it
    (128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.float8e4nv)


def fp8_gemm_hopper(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                    out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                    tile: HopperFp8Tile | None = None, split_k: int | None = None) -> torch.Tensor:
    """fp8_matmul with per-channel scales on a Hopper GPU: x_q [M, K] float8 and x_s [M, 1], w_q [N, K]
    float8 contiguous and w_s [N, 1] -> [M, N] in out_dtype, x_q's rows and w_q 16-byte aligned as TMA
    reads them (fresh tensors, K a multiple of 16). tile: hopper_tile's by default;
    split_k: every tile split in about that many K ranges instead of balanced_split's schedule."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if x_s.numel() != m or w_s.numel() != n:
        raise ValueError(f"fp8_gemm_hopper: needs one scale a token and one a feature; got x_s "
                         f"{tuple(x_s.shape)} for {m} tokens, w_s {tuple(w_s.shape)} for {n} features")
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    tile = tile or hopper_tile(m)
    tiles, whole_tiles, splits = schedule(m, n, k, sm_count(x_q.device), tile)
    if split_k:
        whole_tiles, splits = 0, split_k
    k_per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), splits) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)
    partial, arrivals = split_workspace(out, tiles, splits > 1)

    def operand(t: torch.Tensor, rows: int) -> TensorDescriptor:
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, BLOCK_K], operand_layout(rows))
    x_desc = operand(x_q, tile.block_m)
    x2_desc = operand(x_q, tile.extra_m) if tile.extra_m else x_desc   # read only for a second piece
    _fp8_gemm_hopper_kernel[(whole_tiles + (tiles - whole_tiles) * splits,)](
        x_desc, x2_desc, operand(w_q, tile.block_n), x_s, w_s, bias if bias is not None else w_s, out, partial,
        arrivals, m, n, k, k_per_split, triton.cdiv(m, tile.block_m + tile.extra_m), whole_tiles, splits,
        HAS_BIAS=bias is not None, BLOCK_N=tile.block_n, BLOCK_M=tile.block_m, EXTRA_M=tile.extra_m,
        STAGES=tile.stages, SPLIT=splits > 1, num_warps=tile.num_warps)
    return out
