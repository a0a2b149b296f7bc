"""Float8 (e4m3) products: y = dequant(x_q) @ dequant(w_q).T + bias, each route a plain entry point.

Weights w_q [N, K] float8 carry float32 scales w_s [N, G]: one per output row and group of
`group_size` input columns (G = ceil(K / group_size)). Per-channel scales are the case G = 1
(group_size = K); a per-tensor scale is a per-channel one repeated; block [128, 128] scales are kept
per row (each row repeats its block's scale), so every layout is one kernel.

Activations are quantized per token, or per token and group for G > 1, right before the GEMM:
scale = max|x| / 448 over the token's (group of) columns, x_q = e4m3(x / scale). A static
per-tensor input scale (checkpoints that ship `input_scale`) replaces the per-token maximum.

The GEMM sums each group's float8 products in float32 and scales them by a_s[m, g] * w_s[n, g]:
    y[m, n] = sum_g a_s[m, g] * w_s[n, g] * sum_{k in g} x_q[m, k] * w_q[n, k]
`quantize_activation_ref` and `fp8_matmul_ref` are the torch twins (dequantize, then a float32
matmul); they are also the CPU path. The routes: `fp8_matmul` (the Triton kernel, on gemm_tile's
tiles or, transposed for decode batches, on `decode_tile`'s, `two_piece_tile`'s or
`two_piece_block_tile`'s), `scaled_mm_per_channel` (torch._scaled_mm, row-wise scales, Hopper) and
`scaled_mm_blocks` (torch's scaled_mm, 128 x 128 blocks, Hopper), beside fp8_gemm_hopper.py's Gluon
GEMM (per-channel, Hopper, 129-256 tokens); a few 16-bit rows skip the
quantization and stream the weight through fp8_gemv.py. Which one a layer takes for a call is its
method's choice (nanovllm/quantization/fp8.py, `Fp8LinearMethod.route`).

The kernel that makes a linear layer's input (RMSNorm, SiLU-and-mul) may quantize it in the same pass
(`quantize_groups`) and hand the layer a `QuantizedActivation` instead (nanovllm/layers/layernorm.py,
activation.py).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_primitives import (FP8_DTYPE, QuantizedActivation, dequantize_ref, num_groups,
                                             quantize_activation_ref)
from nanovllm.kernels.split_slices import add_split_slices, split_slices
from nanovllm.kernels.triton_compat import INTERPRETED, pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel


def fp8_matmul_ref(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group_size: int,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = dequantize_ref(x_q, x_s, group_size) @ dequantize_ref(w_q, w_s, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@triton.jit
def round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32, so that
    the cast that follows is exact. Only the interpreter needs it: it rounds some values that carry
    into the next power of two wrongly (127 -> 64); a GPU's cast rounds to nearest even itself."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)   # 3 mantissa bits
    # below 2^-6 the step is 2^-9: |x| * 512 (exact) plus 1.5 * 2^23 has no fraction bits left, so
    # the add rounds to an integer, ties to even as the float unit does (as torch's cast does);
    # then x's sign goes back on (-0 stays -0)
    magnitude = (tl.abs(x) * 512.0 + 12582912.0 - 12582912.0) * 0.001953125
    subnormal = (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def activation_scale(absmax):
    """quantize_activation_ref's scale of a token (group) whose largest |x| is absmax."""
    return tl.maximum(absmax * (1.0 / 448.0), 1e-12)


@triton.jit
def e4m3_codes(x, scale):
    """x / scale (float32) clamped to +-448, ready for the cast to float8e4nv (exact in the
    interpreter too). div_rn: correctly rounded as torch's division of two tensors (Triton's `/` is
    div.full, approximate)."""
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    if INTERPRETED:
        q = round_to_e4m3(q)
    return q


@triton.jit
def quantize_groups(y, ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """y [ROWS, BLOCK] float32 -> (e4m3 values [ROWS, BLOCK] in float32, scales [ROWS, BLOCK // GROUP]):
    quantize_activation_ref's math over groups of GROUP columns held in registers, for the kernel
    that produces an activation to quantize it in its own pass (rms_norm.py, silu_and_mul.py)."""
    groups = tl.reshape(y, [ROWS, BLOCK // GROUP, GROUP])
    scale = activation_scale(tl.max(tl.abs(groups), 2))
    q = e4m3_codes(groups, scale[:, :, None])
    return tl.reshape(q, [ROWS, BLOCK]), scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, GROUP, NUM_GROUPS,
                     STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row and group, the group read once, into registers (BLOCK >= GROUP)."""
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row, group = tl.program_id(0), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, BLOCK)
    mask = (cols < K) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = activation_scale(tl.max(tl.abs(x), axis=0))
    tl.store(s_ptr + row * NUM_GROUPS + group, scale)
    tl.store(q_ptr + row * K + cols, e4m3_codes(x, scale).to(tl.float8e4nv), mask=mask)


def quantize_activation(x: torch.Tensor, group_size: int,
                        static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton twin of `quantize_activation_ref` (x [M, K], last dimension contiguous)."""
    m, k = x.shape
    assert x.stride(1) == 1
    groups = 1 if static_scale is not None else num_groups(k, group_size)
    x_q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return x_q, scales
    group = k if static_scale is not None else min(k, group_size)
    block = triton.next_power_of_2(group)
    _quantize_kernel[(m, groups)](x, x_q, scales, static_scale if static_scale is not None else scales, k,
                                  x.stride(0), group, groups, STATIC=static_scale is not None, BLOCK=block,
                                  num_warps=min(16, max(4, block // 512)), **pdl_launch(x))
    return x_q, scales


class GemmTile(NamedTuple):
    block_m: int            # tokens per program
    block_n: int            # output features per program
    block_k: int            # input columns per step (a divisor of the group with per-group scales)
    num_warps: int
    num_stages: int
    split_k: int = 1        # programs sharing one tile's K range (float32 sums, one slice each)
    swapped: bool = False   # computed as out^T = w @ x^T
    extra_m: int = 0        # swapped: tokens of a second piece after block_m, multiplied by the same weight tile


@triton.jit
def _finish_piece(acc, rows, cols, M, N, a_s_ptr, w_s_ptr, bias_ptr, out_ptr, partial_ptr, count, pid_k,
                  HAS_BIAS: tl.constexpr, PER_GROUP: tl.constexpr, SPLIT: tl.constexpr):
    """Writes the sums acc [tokens, features] of `rows` x `cols`: scaled per row and column (per-channel
    scales), the bias added by the first K split, stored, or added with the other splits' at `count`."""
    row_ok, col_ok = rows < M, cols < N
    if not PER_GROUP:
        a_s = tl.load(a_s_ptr + rows, mask=row_ok, other=0.0)
        w_s = tl.load(w_s_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * (a_s[:, None] * w_s[None, :])
    if HAS_BIAS:    # added once: by the first K split
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    offsets = rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:   # (atomic sums gave wrong tiles now and then here too: split_slices.py)
        add_split_slices(acc, partial_ptr, out_ptr, offsets, mask, pid_k, tl.num_programs(2), M * N, count)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, bias_ptr, out_ptr, partial_ptr, arrivals_ptr, M, N, K,
                     NUM_GROUPS, GROUP, K_PER_SPLIT,
                     HAS_BIAS: tl.constexpr, PER_GROUP: tl.constexpr, SPLIT: tl.constexpr, SWAPPED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXTRA_M: tl.constexpr,
                     PDL: tl.constexpr):
    """One tile of tokens x output features over one K range. SWAPPED: the tile is computed as
    out^T = w @ a^T, so the weight's rows fill the matrix cores' tall side and a decode batch still
    makes enough programs to keep every SM reading the weight (a 128 x 128 tile of tokens x features
    gives 64 programs for 4096 features at 256 tokens); its programs walk the features first.
    EXTRA_M (swapped only): the tile's tokens are a piece of BLOCK_M and a second of EXTRA_M, both
    multiplied by each weight tile, so 160 tokens run 128 + 32 wide where one piece (a power of two)
    would run 256."""
    wait_for_previous_kernel(PDL)
    if SWAPPED:
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pid_k = tl.program_id(2)
    rows = pid_m * (BLOCK_M + EXTRA_M) + tl.arange(0, BLOCK_M)
    if EXTRA_M > 0:
        rows2 = pid_m * (BLOCK_M + EXTRA_M) + BLOCK_M + tl.arange(0, EXTRA_M)
        row2_ok = rows2 < M
        acc2 = tl.zeros([BLOCK_N, EXTRA_M], dtype=tl.float32)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k in range(k_start, k_end, BLOCK_K):
        k_ok = k + ks < k_end
        a = tl.load(a_ptr + rows[:, None] * K + k + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + k + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if EXTRA_M > 0:
            a2 = tl.load(a_ptr + rows2[:, None] * K + k + ks[None, :], mask=row2_ok[:, None] & k_ok[None, :], other=0.0)
        if PER_GROUP:   # BLOCK_K divides the group: scale each step's products by its group's scales
            g = k // GROUP
            a_s = tl.load(a_s_ptr + rows * NUM_GROUPS + g, mask=row_ok, other=0.0)
            w_s = tl.load(w_s_ptr + cols * NUM_GROUPS + g, mask=col_ok, other=0.0)
            if SWAPPED:
                acc += tl.dot(w, tl.trans(a)) * (w_s[:, None] * a_s[None, :])
                if EXTRA_M > 0:
                    a_s2 = tl.load(a_s_ptr + rows2 * NUM_GROUPS + g, mask=row2_ok, other=0.0)
                    acc2 += tl.dot(w, tl.trans(a2)) * (w_s[:, None] * a_s2[None, :])
            else:
                acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * w_s[None, :])
        elif SWAPPED:
            acc = tl.dot(w, tl.trans(a), acc)
            if EXTRA_M > 0:
                acc2 = tl.dot(w, tl.trans(a2), acc2)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if SWAPPED:
        acc = tl.trans(acc)
    # each piece of a tile counts its K splits in at an arrival count of its own
    pieces = 2 if EXTRA_M > 0 else 1
    count = arrivals_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * pieces
    _finish_piece(acc, rows, cols, M, N, a_s_ptr, w_s_ptr, bias_ptr, out_ptr, partial_ptr, count, pid_k,
                  HAS_BIAS, PER_GROUP, SPLIT)
    if EXTRA_M > 0:
        _finish_piece(tl.trans(acc2), rows2, cols, M, N, a_s_ptr, w_s_ptr, bias_ptr, out_ptr, partial_ptr,
                      count + 1, pid_k, HAS_BIAS, PER_GROUP, SPLIT)


# The transposed tile of grids that take several waves past 128 tokens: 256 tokens a program.
MULTI_WAVE_TILE = GemmTile(256, 64, 128, 8, 5, swapped=True)


def decode_waves(n: int, sms: int) -> int:
    """How many waves over `sms` SMs decode_tile's grid of n features takes up to 128 tokens (64 a tile)."""
    return triton.cdiv(triton.cdiv(n, 64), sms)


def decode_tile(m: int, n: int, sms: int) -> GemmTile:
    """The transposed tile for a decode batch of m tokens (up to 256) and n output features on `sms`
    SMs, from sweeps of the Qwen3-8B projections (docs/benchmarks.md). Up to 128 tokens the weight's
    bytes set the time: 64 features by the tokens rounded up to a power of two, seven stages and K
    split to about one program per SM where the features alone make fewer (down_proj at 8-128
    tokens 16-21 against 24-27 us unsplit in five stages, H200); grids of several waves (gate_up)
    take five stages up to 32 tokens, three above. Past 128 tokens (H100): 64 features by 128 tokens
    (64 where that leaves half the SMs idle) while the grid fits one wave, 128 features when that
    keeps it in one wave, else MULTI_WAVE_TILE."""
    if m <= 128:
        block_m = max(16, triton.next_power_of_2(m))
        if decode_waves(n, sms) == 1:
            return GemmTile(block_m, 64, 128, 4, 7, max(1, round(sms / triton.cdiv(n, 64))), swapped=True)
        return GemmTile(block_m, 64, 128, 4, 5 if block_m <= 32 else 3, swapped=True)
    programs = lambda block_n, block_m: triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    block_m = 64 if programs(64, 128) <= sms // 2 else 128
    if programs(64, block_m) <= sms:
        return GemmTile(block_m, 64, 128, 4, 5, swapped=True)
    if programs(128, block_m) <= sms:
        return GemmTile(block_m, 128, 128, 8, 5, swapped=True)
    return MULTI_WAVE_TILE


def two_piece_tile(m: int, n: int, k: int, sms: int) -> GemmTile | None:
    """The transposed tile of two pieces, 128 tokens and the rest rounded up to a power of two, for
    129-192 tokens of per-channel products [m, k] @ [k, n] on `sms` SMs, where it beats decode_tile's
    tiles, which run 256 tokens wide (8B projections, H200, docs/benchmarks.md); None where they win."""
    if not 128 < m <= 192:
        return None
    extra = max(16, triton.next_power_of_2(m - 128))     # tl.dot's sides are 16 or more
    tiles = triton.cdiv(n, 64)
    if tiles > sms and extra <= 32:     # several waves (gate_up: 38.2 against 53.8 us at 144 tokens)
        return GemmTile(128, 128, 128, 8, 3, 1, True, extra)
    # one wave (qkv: 14.6 against 15.8 us at 144), or several with a wider second piece (gate_up: 46.9
    # against 54.1 at 176)
    if tiles > sms // 2:
        return GemmTile(128, 64, 128, 4, 5, 1, True, extra)
    if k >= 8192:                       # half a wave: K split in two (down: 25.7 against 30.1 us at 144)
        return GemmTile(128, 64, 128, 4, 5, 2, True, extra)
    return None     # o: two 128-token tiles keep twice the programs reading (11.9 against 13.4)


def two_piece_block_tile(m: int, n: int, k: int, sms: int) -> GemmTile | None:
    """two_piece_tile for products with block [128, 128] scales: 64 features, 3 stages, for 129-160
    tokens only. A second piece of 64 tokens lost to decode_tile's tiles on every projection (gate_up
    152 against 113 us at 176 tokens), and o kept them (24.2 against 28.8 at 160; 8B, H200)."""
    if not 128 < m <= 160:
        return None
    extra = max(16, triton.next_power_of_2(m - 128))
    if k >= 8192:                       # down: 56.1 / 69.6 against 78.8 / 78.5 us at 144 / 160 tokens
        return GemmTile(128, 64, 128, 4, 3, 3, True, extra)
    if triton.cdiv(n, 64) > sms // 2:   # qkv 30.7 / 36.6 against 56.8 / 55.7, gate_up 91.1 / 97.9 against 110.7 / 112.6
        return GemmTile(128, 64, 128, 4, 3, 2 if extra == 16 else 1, True, extra)
    return None


def gemm_tile(m: int, group_size: int, per_group: bool) -> GemmTile:
    """Short tiles for decode, tall for prefill."""
    block_k = min(128, group_size) if per_group else 128
    if m <= 16:
        return GemmTile(16, 64, block_k, 4, 4)
    if m <= 64:
        return GemmTile(64, 64, block_k, 4, 4)
    return GemmTile(128, 128, block_k, 8, 3)


def fp8_matmul(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group_size: int,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None, tile: GemmTile | None = None) -> torch.Tensor:
    """The Triton twin of `fp8_matmul_ref`: x_q [M, K], x_s [M, G] (or [M, 1] for per-channel), w_q [N, K]
    contiguous, w_s [N, G]. A per-group GEMM needs group_size a power of two of at least 16; its K
    step is at most the group, and a K split's range a multiple of the step. tile: gemm_tile's by default."""
    m, k = x_q.shape
    n = w_q.shape[0]
    groups = w_s.shape[1]
    per_group = groups > 1
    assert not per_group or (group_size >= 16 and group_size & (group_size - 1) == 0)
    block_m, block_n, block_k, warps, stages, split_k, swapped, extra_m = tile or gemm_tile(m, group_size, per_group)
    assert swapped or not extra_m, "a second piece of tokens needs the transposed tile"
    if per_group:
        block_k = min(block_k, group_size)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    tiles = (triton.cdiv(n, block_n), triton.cdiv(m, block_m + extra_m)) if swapped else \
        (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    grid = (*tiles, split_k)
    partial, arrivals = split_slices(out, split_k, tiles[0] * tiles[1] * (2 if extra_m else 1))
    _fp8_gemm_kernel[grid](x_q, x_s, w_q, w_s, bias if bias is not None else w_s, out, partial, arrivals, m, n, k,
                           groups, group_size, k_per_split, HAS_BIAS=bias is not None, PER_GROUP=per_group,
                           SPLIT=split_k > 1, SWAPPED=swapped, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           EXTRA_M=extra_m, num_warps=warps, num_stages=stages, **pdl_launch(x_q))
    return out


def scaled_mm_per_channel(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                          out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales (Hopper): x_s [M, 1], w_s [N, 1]."""
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.reshape(1, -1), bias=bias, out_dtype=out_dtype)


# torch's scaled_mm takes float8 block scales (1 x 128 for activations, 128 x 128 for weights) on Hopper
# where it has ScalingType and runs on CUDA 12.9 or later, which cuBLASLt needs for them
BLOCK_SCALED_MM_ROWS = 16    # rows padded to a multiple of this: the row counts checked on an H200


def block_scaled_mm_available() -> bool:
    cuda = torch.version.cuda
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and cuda is not None \
        and tuple(int(part) for part in cuda.split(".")[:2]) >= (12, 9)


def block_scaled_mm_operands(x_q: torch.Tensor, x_s: torch.Tensor,
                             w_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operands cuBLASLt takes for block scales, from ours: x_q [M, K] with its rows padded by
    zeros to a multiple of BLOCK_SCALED_MM_ROWS, their scales x_s [M, K / 128] padded by ones and
    column-major, and one scale a block, [K / 128, N / 128] (a transposed view), from w_s [N, K / 128]
    whose every 128 rows repeat their block's scale (the block layout's per-row copies)."""
    pad = -x_q.shape[0] % BLOCK_SCALED_MM_ROWS
    if pad:
        x_q = F.pad(x_q.view(torch.uint8), (0, 0, 0, pad)).view(x_q.dtype)   # byte 0 is e4m3's +0
        x_s = F.pad(x_s, (0, 0, 0, pad), value=1.0)
    return x_q, x_s.t().contiguous().t(), w_s[::128].contiguous().t()


def scaled_mm_blocks(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's scaled_mm (cuBLASLt) with 128 x 128 weight blocks (block_scaled_mm_available, Hopper):
    the same product as fp8_matmul's with group_size 128, for w_s in whole blocks."""
    a, a_s, w_blocks = block_scaled_mm_operands(x_q, x_s, w_s)
    y = F.scaled_mm(a, w_q.t(), a_s, F.ScalingType.BlockWise1x128, w_blocks, F.ScalingType.BlockWise128x128,
                    output_dtype=out_dtype)[:x_q.shape[0]]
    return y if bias is None else y + bias
