"""Few-row products with float8 (e4m3) weights and 16-bit activations: y = x @ dequant(w_q).T + bias.

At decode (a few rows) the product is bound by reading the weight bytes, so the activations are not
quantized: x stays 16-bit and each weight tile is widened in registers (e4m3 is exact in float16 and
bfloat16), products summed in float32. The numerics are those of the dequantized weight with
unquantized activations, slightly closer to the 16-bit model than fp8_linear.py's W8A8 path, which
larger batches keep (they are bound by the matrix cores, where float8 x float8 pays).

Weights w_q [N, K] float8 with float32 scales w_s [N, G]: per row (G = 1) or per row and group of
`group_size` input columns (fp8_linear.py's layout of block scales). Each program streams a run of
BLOCK_N whole weight rows along K with wide contiguous loads; when that leaves too few programs to
keep every SM reading (small N), K is split over programs too and their float32 partial sums meet
by atomic adds. One row (M = 1) multiplies element-wise and reduces once at the end, its weight
tiles loaded num_stages steps ahead (no matrix product, so the pipelining is asked for: tl.range);
2 to 16 rows go through a 16-row matrix-core product per tile.
`fp8_gemv_ref` is the torch twin.
"""
import functools
from typing import NamedTuple

import torch

from nanovllm.kernels.fp8_primitives import dequantize_ref
from nanovllm.kernels.silu_epilogue import gated_columns, silu_and_mul_store
from nanovllm.kernels.triton_compat import pdl_launch, tl, triton, wait_for_previous_kernel

# Split K while the grid has fewer than this many programs per SM (weight streams in flight on every SM).
PROGRAMS_PER_SM = 4


class GemvConfig(NamedTuple):
    block_n: int        # weight rows (fp8) or packed columns (int) per program
    block_k: int        # input columns per loop step
    num_warps: int
    num_stages: int


# One row: 8 rows x 1024 bytes per step (16-byte loads), loaded 3 steps ahead (the best single
# launch over the 8B projections on one H100, docs/benchmarks.md); more rows: the 16x16 matrix-core tile.
ONE_ROW_CONFIG = GemvConfig(8, 1024, 4, 3)
FEW_ROWS_CONFIG = GemvConfig(16, 256, 4, 4)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_k_for(x: torch.Tensor, column_programs: int, k: int, block_k: int) -> int:
    """How many programs share each output tile's K range so the grid fills the GPU."""
    if not x.is_cuda:
        return 1 if column_programs >= 8 else min(2, triton.cdiv(k, block_k))   # the interpreter: exercise both
    # rounded down: a split costs two small kernels (zeroing the float32 sums, then casting them)
    return max(1, min(PROGRAMS_PER_SM * sm_count(x.device) // column_programs, triton.cdiv(k, block_k)))


def fp8_gemv_ref(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin: float32 product of x and the dequantized weight, in x's dtype."""
    y = x.float() @ dequantize_ref(w_q, w_s, group_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(x_ptr, w_ptr, w_s_ptr, bias_ptr, out_ptr, M, N, K, stride_x, NUM_GROUPS, GROUP_SIZE, K_PER_SPLIT,
                     PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_STEP: tl.constexpr, INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
                     ONE_ROW_STAGES: tl.constexpr = 1, GATED: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if GATED:
        cols, col_ok = gated_columns(pid_n, N // 2, BLOCK_N)
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    if BLOCK_M == 1:
        # element-wise products kept per lane, one reduction across K at the end; a step covers
        # BLOCK_K // GROUP_STEP runs of GROUP_STEP columns, each inside one scale group
        runs = tl.arange(0, BLOCK_K // GROUP_STEP)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K // GROUP_STEP, GROUP_STEP), dtype=tl.float32)
        x_row = x_ptr + pid_m * stride_x
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=ONE_ROW_STAGES):
            kcol = k0 + runs[:, None] * GROUP_STEP + tl.arange(0, GROUP_STEP)[None, :]
            k_ok = kcol < k_end
            x = tl.load(x_row + kcol, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
            w = tl.load(w_rows[:, :, None] + kcol[None, :, :], mask=col_ok[:, None, None] & k_ok[None, :, :],
                        other=0.0).to(tl.float32)
            if PER_GROUP:
                g = (k0 + runs * GROUP_STEP) // GROUP_SIZE
                s = tl.load(w_s_ptr + cols[:, None] * NUM_GROUPS + g[None, :],
                            mask=col_ok[:, None] & (g < NUM_GROUPS)[None, :], other=0.0)
                acc3 += w * x * s[:, :, None]
            else:
                acc3 += w * x
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)[None, :]
        rows = pid_m + tl.arange(0, 1)
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = k0 + ks < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_x + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_rows + k0 + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
            if PER_GROUP:
                s = tl.load(w_s_ptr + cols * NUM_GROUPS + k0 // GROUP_SIZE,
                            mask=col_ok, other=0.0)
                acc += tl.dot(x, tl.trans(w), input_precision=INPUT_PRECISION) * s[None, :]
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=INPUT_PRECISION)
    if not PER_GROUP:
        acc = acc * tl.load(w_s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:    # added once: by the first K split
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    if GATED:
        silu_and_mul_store(out_ptr, acc, rows, pid_n * (BLOCK_N // 2), M, N // 2, BLOCK_N)
        return
    out = out_ptr + rows[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & col_ok[None, :]
    if SPLIT:
        # relaxed: the sums are read only after this kernel ends (the default, acq_rel, fences each add)
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_gemv(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, config: GemvConfig | None = None,
             split_k: int | None = None, gated: bool = False) -> torch.Tensor | None:
    """The Triton twin of `fp8_gemv_ref`: x [M, K] (last dimension contiguous), w_q [N, K] contiguous,
    w_s [N, G]; with G > 1, group_size is a power of two of at least 16 and K's groups are
    ceil(K / group_size). Meant for a few rows (how many: nanovllm/quantization/fp8.py,
    GEMV_MAX_ROWS); larger M runs, in tiles of 16 rows.
    gated: w_q is a merged [gate; up] matrix and the result is silu(gate) * up [M, N // 2]
    (silu_epilogue.py); None when K would be split (the sums then meet by atomic adds, after which
    no program sees a finished gate and up)."""
    m, k = x.shape
    n = w_q.shape[0]
    groups = w_s.shape[1]
    per_group = groups > 1
    if per_group and (group_size < 16 or group_size & (group_size - 1) or groups != triton.cdiv(k, group_size)):
        raise ValueError(f"fp8_gemv: group_size {group_size} must be a power of two >= 16 with "
                         f"ceil(K / group_size) = {groups} scale columns (K = {k})")
    block_m = 1 if m == 1 else 16
    block_n, block_k, num_warps, num_stages = config or (ONE_ROW_CONFIG if m == 1 else FEW_ROWS_CONFIG)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    # runs of columns inside one scale group: one row steps over several, more rows one at a time
    group_step = min(block_k, group_size) if per_group else block_k
    if block_m > 1:
        block_k = group_step
    assert not gated or n % 2 == 0      # then the n // 2 outputs take cdiv(n, block_n) programs too
    # one row of a small layer: half as many rows per program before splitting K (a split costs
    # two kernels more; Qwen3-30B-A3B's o_proj, 2048 x 4096)
    while config is None and m == 1 and x.is_cuda and block_n > 4 and not split_k and \
            split_k_for(x, triton.cdiv(n, block_n), k, block_k) > 1:
        block_n //= 2
    column_programs = triton.cdiv(n, block_n)
    split_k = split_k or split_k_for(x, column_programs, k, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if gated and split_k > 1:
        return None
    out_n = n // 2 if gated else n
    out = torch.zeros(m, out_n, dtype=torch.float32, device=x.device) if split_k > 1 else \
        torch.empty(m, out_n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    grid = (column_programs, split_k, m if block_m == 1 else triton.cdiv(m, block_m))
    _fp8_gemv_kernel[grid](x, w_q, w_s, bias if bias is not None else w_s, out, m, n, k, x.stride(0), groups,
                           group_size, k_per_split, PER_GROUP=per_group, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_STEP=group_step,
                           INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
                           num_warps=num_warps, num_stages=num_stages, ONE_ROW_STAGES=num_stages if block_m == 1 else 1,
                           GATED=gated, **pdl_launch(x))
    return out.to(x.dtype) if split_k > 1 else out
