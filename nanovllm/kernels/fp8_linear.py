"""Linear layers with float8 (e4m3) weights and activations: y = dequant(x_q) @ dequant(w_q).T + bias.

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
matmul); they are also the CPU path. On Hopper the per-channel case may go to torch._scaled_mm
(CUTLASS/cuBLASLt, row-wise scales) instead of the Triton kernel: `SCALED_MM_PER_CHANNEL` says
which, as measured (docs/benchmarks.md, quantized weights). Decode batches (up to 256 tokens) run
the Triton kernel transposed, on the tiles `decode_tile` picks.

The kernel that makes a linear layer's input (RMSNorm, SiLU-and-mul) may quantize it in the same pass
and hand fp8_linear a `QuantizedActivation` instead (nanovllm/layers/layernorm.py, activation.py).
"""
from typing import NamedTuple

import torch

from nanovllm.kernels.fp8_primitives import (FP8_DTYPE, QuantizedActivation, dequantize_ref, num_groups,
                                             quantize_activation_ref)
from nanovllm.kernels.fp8_gemv import GEMV_MAX_ROWS, fp8_gemv, sm_count
from nanovllm.kernels.triton_compat import (cuda_major_capability, pdl_launch, start_next_kernel, tl, triton,
                                             wait_for_previous_kernel)

# Per-channel GEMMs on Hopper through torch._scaled_mm (True) or the Triton kernel (False). Measured
# on one H100 (Qwen3-8B projections, docs/benchmarks.md; the timing script is in git history): _scaled_mm is as fast or faster at
# most batch sizes (gate_up M=4096: 678 us against 754, bf16 1,191); bench.py with the 8B shape,
# online FP8 and FP8 KV: 10,998 tok/s with it, 9,967 with the Triton kernel.
SCALED_MM_PER_CHANNEL = True
# The transposed GEMM serves products of at most this many tokens (decode batches); see decode_tile.
SWAPPED_MAX_ROWS = 256


def quantizes_activation(x: torch.Tensor) -> bool:
    """Whether fp8_linear quantizes x (dynamic scales) rather than sending it to the GEMV: always on
    the CPU, above GEMV_MAX_ROWS rows on CUDA. Where it does, the producer of x may do it instead."""
    return not x.is_cuda or x.shape[:-1].numel() > GEMV_MAX_ROWS


def fp8_matmul_ref(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group_size: int,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = dequantize_ref(x_q, x_s, group_size) @ dequantize_ref(w_q, w_s, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@triton.jit
def round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, in float32. The cast
    that follows is then exact: Triton's interpreter rounds some values that carry into the next
    power of two wrongly (127 -> 64), GPUs do not; both now give the same bits."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)   # 3 mantissa bits
    # below 2^-6 the step is 2^-9: |x| * 512 (exact) plus 1.5 * 2^23 has no fraction bits left, so
    # the add rounds to an integer, ties to even as the float unit does (as torch's cast does);
    # then x's sign goes back on (-0 stays -0)
    magnitude = (tl.abs(x) * 512.0 + 12582912.0 - 12582912.0) * 0.001953125
    subnormal = (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def quantize_groups(y, ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """y [ROWS, BLOCK] float32 -> (e4m3 values [ROWS, BLOCK] in float32, scales [ROWS, BLOCK // GROUP]):
    quantize_activation_ref's math over groups of GROUP columns held in registers, for the kernel
    that produces an activation to quantize it in its own pass (rms_norm.py, silu_and_mul.py)."""
    groups = tl.reshape(y, [ROWS, BLOCK // GROUP, GROUP])
    scale = tl.maximum(tl.max(tl.abs(groups), 2) * (1.0 / 448.0), 1e-12)
    q = round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(groups, scale[:, :, None]), -448.0), 448.0))
    return tl.reshape(q, [ROWS, BLOCK]), scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, GROUP, NUM_GROUPS,
                     STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row, group = tl.program_id(0), tl.program_id(1)
    start = group * GROUP
    end = tl.minimum(start + GROUP, K)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        absmax = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(start, end, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
        scale = tl.maximum(tl.max(absmax, axis=0) * (1.0 / 448.0), 1e-12)
    tl.store(s_ptr + row * NUM_GROUPS + group, scale)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
        # div_rn: correctly rounded as torch's division of two tensors (Triton's `/` is div.full, approximate)
        q = round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0))
        tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=cols < end)


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
    block = min(1024, triton.next_power_of_2(min(k, group_size)))
    _quantize_kernel[(m, groups)](x, x_q, scales, static_scale if static_scale is not None else scales, k,
                                  x.stride(0), k if static_scale is not None else group_size, groups,
                                  STATIC=static_scale is not None, BLOCK=block, **pdl_launch(x))
    return x_q, scales


class GemmTile(NamedTuple):
    block_m: int            # tokens per program
    block_n: int            # output features per program
    block_k: int            # input columns per step (a divisor of the group with per-group scales)
    num_warps: int
    num_stages: int
    split_k: int = 1        # programs sharing one tile's K range (float32 partial sums, atomic adds)
    swapped: bool = False   # computed as out^T = w @ x^T


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_s_ptr, w_ptr, w_s_ptr, bias_ptr, out_ptr, M, N, K, NUM_GROUPS, GROUP, K_PER_SPLIT,
                     HAS_BIAS: tl.constexpr, PER_GROUP: tl.constexpr, SPLIT: tl.constexpr, SWAPPED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One tile of tokens x output features over one K range. SWAPPED: the tile is computed as
    out^T = w @ a^T, so the weight's rows fill the matrix cores' tall side and a decode batch still
    makes enough programs to keep every SM reading the weight (a 128 x 128 tile of tokens x features
    gives 64 programs for 4096 features at 256 tokens); its programs walk the features first."""
    wait_for_previous_kernel(PDL)
    if SWAPPED:
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k in range(k_start, k_end, BLOCK_K):
        k_ok = k + ks < k_end
        a = tl.load(a_ptr + rows[:, None] * K + k + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + k + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if PER_GROUP:   # BLOCK_K divides the group: scale each step's products by its group's scales
            g = k // GROUP
            a_s = tl.load(a_s_ptr + rows * NUM_GROUPS + g, mask=row_ok, other=0.0)
            w_s = tl.load(w_s_ptr + cols * NUM_GROUPS + g, mask=col_ok, other=0.0)
            if SWAPPED:
                acc += tl.dot(w, tl.trans(a)) * (w_s[:, None] * a_s[None, :])
            else:
                acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * w_s[None, :])
        elif SWAPPED:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if SWAPPED:
        acc = tl.trans(acc)
    if not PER_GROUP:
        a_s = tl.load(a_s_ptr + rows, mask=row_ok, other=0.0)
        w_s = tl.load(w_s_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * (a_s[:, None] * w_s[None, :])
    if HAS_BIAS:    # added once: by the first K split
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    out = out_ptr + rows[:, None] * N + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        # relaxed: the sums are read only after this kernel ends (the default, acq_rel, fences each add)
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def decode_tile(m: int, n: int, sms: int, per_group: bool) -> GemmTile | None:
    """The swapped tile for m tokens and n output features on `sms` SMs, or None where the other
    routes are faster. From a sweep of the Qwen3-8B projections at 64-256 tokens on one H100
    (docs/benchmarks.md): 64 features by 64 or 128 tokens with five stages while the grid fits one
    wave, 128 features when that keeps it in one wave; grids of several waves (gate_up) want three
    stages, or 256 tokens a program past 128 tokens, where cuBLASLt's row-wise GEMM wins from 256.
    Block scales at up to 16 tokens keep gemm_tile's 16-token tile (4.28 ms against 4.70 for the 8B
    projections of 36 layers)."""
    if m > SWAPPED_MAX_ROWS or (per_group and m <= 16):
        return None
    programs = lambda block_n, block_m: triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    block_m = 64 if m <= 64 or programs(64, 128) <= sms // 2 else 128
    if programs(64, block_m) <= sms:
        return GemmTile(block_m, 64, 128, 4, 5, swapped=True)
    if programs(128, block_m) <= sms:
        return GemmTile(block_m, 128, 128, 8, 5, swapped=True)
    if m <= 128:
        return GemmTile(block_m, 64, 128, 4, 3, swapped=True)
    return GemmTile(256, 64, 128, 8, 5, swapped=True) if per_group or m <= 192 else None


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
    block_m, block_n, block_k, warps, stages, split_k, swapped = tile or gemm_tile(m, group_size, per_group)
    if per_group:
        block_k = min(block_k, group_size)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.zeros(m, n, dtype=torch.float32, device=x_q.device) if split_k > 1 else \
        torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out.to(out_dtype)
    tiles = (triton.cdiv(n, block_n), triton.cdiv(m, block_m)) if swapped else \
        (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[(*tiles, split_k)](x_q, x_s, w_q, w_s, bias if bias is not None else w_s, out, m, n, k, groups,
                                        group_size, k_per_split, HAS_BIAS=bias is not None, PER_GROUP=per_group,
                                        SPLIT=split_k > 1, SWAPPED=swapped, BLOCK_M=block_m, BLOCK_N=block_n,
                                        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_launch(x_q))
    return out.to(out_dtype) if split_k > 1 else out


def scaled_mm_per_channel(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                          out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales (Hopper): x_s [M, 1], w_s [N, 1]."""
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.reshape(1, -1), bias=bias, out_dtype=out_dtype)


def fp8_linear(x: torch.Tensor | QuantizedActivation, w_q: torch.Tensor, w_s: torch.Tensor, group_size: int,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] 16/32-bit -> [..., N] in x's dtype: quantize the activations, then the float8 GEMM.
    x may come quantized already (a QuantizedActivation [M, K] in this layer's group size): then only
    the GEMM runs. On CUDA, up to GEMV_MAX_ROWS 16-bit rows without a static input scale skip the
    quantization and stream the weight through fp8_gemv (16-bit activations: see fp8_gemv.py).
    The CPU runs the twins."""
    if isinstance(x, QuantizedActivation):
        gemm = fp8_gemm if x.q.is_cuda else fp8_matmul_ref
        return gemm(x.q, x.scale, w_q, w_s, group_size, x.dtype, bias)
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if takes_gemv(x, input_scale):
        y = fp8_gemv(x.contiguous() if x.stride(-1) != 1 else x, w_q, w_s, group_size, bias)
    elif not x.is_cuda:
        x_q, x_s = quantize_activation_ref(x, group_size, input_scale)
        y = fp8_matmul_ref(x_q, x_s, w_q, w_s, group_size, x.dtype, bias)
    else:
        x_q, x_s = quantize_activation(x.contiguous() if x.stride(-1) != 1 else x, group_size, input_scale)
        y = fp8_gemm(x_q, x_s, w_q, w_s, group_size, x.dtype, bias)
    return y.reshape(*shape[:-1], y.shape[-1])


def takes_gemv(x: torch.Tensor, input_scale: torch.Tensor | None) -> bool:
    """Whether fp8_linear streams x [M, K] through fp8_gemv: a few 16-bit rows on CUDA, no static
    input scale."""
    return x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS and input_scale is None and x.dtype != torch.float32


def fp8_linear_silu_and_mul(x: torch.Tensor | QuantizedActivation, w_q: torch.Tensor, w_s: torch.Tensor,
                            group_size: int, input_scale: torch.Tensor | None = None,
                            bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(gate) * up of a merged [gate; up] layer, from the GEMV's epilogue, where fp8_linear would
    take the GEMV path (and the GEMV does not split K); None elsewhere: the caller then runs the
    layer and silu_and_mul apart. Saves a kernel launch and a round trip of gate and up per layer."""
    if isinstance(x, QuantizedActivation) or x.dim() != 2 or not takes_gemv(x, input_scale):
        return None
    return fp8_gemv(x.contiguous() if x.stride(-1) != 1 else x, w_q, w_s, group_size, bias, gated=True)


def fp8_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group_size: int,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float8 product on CUDA by the fastest measured route: decode batches transposed, larger
    per-channel ones through torch._scaled_mm on Hopper in bfloat16, the rest the Triton kernel."""
    per_group = w_s.shape[1] > 1
    tile = decode_tile(x_q.shape[0], w_q.shape[0], sm_count(x_q.device), per_group)
    if tile is not None:
        return fp8_matmul(x_q, x_s, w_q, w_s, group_size, out_dtype, bias, tile)
    if not per_group and SCALED_MM_PER_CHANNEL and cuda_major_capability(x_q) >= 9 and out_dtype == torch.bfloat16:
        return scaled_mm_per_channel(x_q, x_s, w_q, w_s, out_dtype, bias)
    return fp8_matmul(x_q, x_s, w_q, w_s, group_size, out_dtype, bias)
