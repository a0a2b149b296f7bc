"""SwiGLU's activation: silu(gate) * up, with gate and up side by side in one tensor.

`silu_and_mul_quant` writes it quantized to float8 for an FP8 linear layer instead (with its scales,
per token or per token and group): the bits `quantize_activation_ref` gives for the 16-bit output.
"""
import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_primitives import FP8_DTYPE
from nanovllm.kernels.fp8_linear import (QuantizedActivation, activation_scale, e4m3_codes, num_groups,
                                        quantize_activation_ref, quantize_groups)
from nanovllm.kernels.triton_compat import pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_quant_ref(x: torch.Tensor, group_size: int) -> QuantizedActivation:
    """The torch twin of `silu_and_mul_quant`: the 16-bit activation, then its quantization."""
    out = silu_and_mul_ref(x)
    return QuantizedActivation(*quantize_activation_ref(out, group_size), out.dtype)


@triton.jit
def _gate_and_up(x_ptr, row, col, mask, N):
    """One row's gate and up values at columns `col`."""
    return (tl.load(x_ptr + row * 2 * N + col, mask=mask, other=0.0),
            tl.load(x_ptr + row * 2 * N + N + col, mask=mask, other=0.0))


@triton.jit
def _silu_and_mul(x_ptr, row, col, mask, N):
    """silu(gate) * up of one row's columns `col`, in the input dtype."""
    gate, up = _gate_and_up(x_ptr, row, col, mask, N)
    return _silu_times(gate, up)


@triton.jit
def _silu_times(gate, up):
    """silu(gate) * up of loaded values, in up's dtype (silu rounded to it first, as torch's is)."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(up.dtype) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    tl.store(out_ptr + row * N + col, _silu_and_mul(x_ptr, row, col, mask, N), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, N, NUM_GROUPS, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
    """Per token and group: one program per row and BLOCK columns, BLOCK // GROUP groups quantized in registers."""
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    y = _silu_and_mul(x_ptr, row, col, mask, N).to(tl.float32)
    q, scale = quantize_groups(y[None, :], 1, BLOCK, GROUP)
    tl.store(q_ptr + row * N + col[None, :], q.to(tl.float8e4nv), mask=mask[None, :])
    group_ids = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    tl.store(scale_ptr + row * NUM_GROUPS + group_ids[None, :], scale, mask=(group_ids < NUM_GROUPS)[None, :])


@triton.jit
def _silu_and_mul_quant_rows_kernel(x_ptr, q_ptr, scale_ptr, N, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                                    PDL: tl.constexpr):
    """Per token: one program per row, the whole row in registers as NUM_CHUNKS chunks of CHUNK
    columns (one power-of-two block would pad 12,288 columns to 16,384): every chunk is loaded
    before the row's largest |y| is known, then quantized from registers. On an H200 (12,288
    columns, L2 cleared, 4,096 by 8 warps) 11.3 us at 240 rows and 153 at 8,192, against 15.2 and 209
    for two passes over the chunks, the second reading the inputs again (silu_and_mul alone: 9.5 and
    150)."""
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row = tl.program_id(0)
    gates, ups = (), ()
    for c in tl.static_range(NUM_CHUNKS):     # every load first: all are in flight together
        col = c * CHUNK + tl.arange(0, CHUNK)
        gate, up = _gate_and_up(x_ptr, row, col, col < N, N)
        gates, ups = gates + (gate,), ups + (up,)
    absmax = tl.zeros([CHUNK], dtype=tl.float32)
    chunks = ()
    for c in tl.static_range(NUM_CHUNKS):
        y = _silu_times(gates[c], ups[c]).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(y))
        chunks = chunks + (y,)
    scale = activation_scale(tl.max(absmax, 0))
    tl.store(scale_ptr + row, scale)
    for c in tl.static_range(NUM_CHUNKS):
        col = c * CHUNK + tl.arange(0, CHUNK)
        tl.store(q_ptr + row * N + col, e4m3_codes(chunks[c], scale).to(tl.float8e4nv), mask=col < N)


# Columns a chunk of a per-token program and its warps. At 12,288 columns on one H200 (graph replay,
# inputs beyond L2, 2026-12-04) 2,048 by 32 warps takes 3.6 / 6.7 / 6.9 us at 64 / 240 / 256 rows, by
# 16 3.9 / 6.9 / 7.0, against 5.1 / 7.7 / 7.8 for 4,096 by 8 (1,024-4,096 by 4-32 swept): with one
# row a program, more warps keep more of a row's loads in flight. Rows of up to ROW_CHUNKS_PER_16_WARPS
# chunks take 16 warps (not timed apart).
ROW_CHUNK, ROW_CHUNKS_PER_16_WARPS = 2048, 4


def rows_launch(n: int) -> tuple[int, int, int]:
    """The per-token kernel's chunk, chunk count and warps for rows of n columns."""
    chunk = min(ROW_CHUNK, triton.next_power_of_2(n))
    chunks = triton.cdiv(n, chunk)
    return chunk, chunks, 16 if chunks <= ROW_CHUNKS_PER_16_WARPS else 32


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, 2 * N] contiguous -> [tokens, N]."""
    assert x.is_contiguous()
    num_tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, block))](x, out, N=n, BLOCK=block, **pdl_launch(x))
    return out


def silu_and_mul_quant(x: torch.Tensor, group_size: int) -> QuantizedActivation:
    """silu_and_mul of x [tokens, 2 * N] quantized to float8 per token and `group_size` columns (a
    power of two, or N or more: per token, one program per row)."""
    assert x.is_contiguous()
    num_tokens, n = x.shape[0], x.shape[1] // 2
    assert group_size >= n or group_size & (group_size - 1) == 0
    groups = num_groups(n, group_size)
    q = torch.empty(num_tokens, n, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_tokens, groups, dtype=torch.float32, device=x.device)
    if num_tokens and group_size >= n:
        chunk, chunks, warps = rows_launch(n)
        _silu_and_mul_quant_rows_kernel[(num_tokens,)](x, q, scales, n, CHUNK=chunk, NUM_CHUNKS=chunks,
                                                       num_warps=warps, **pdl_launch(x))
    elif num_tokens:
        group, block = group_size, max(group_size, min(1024, triton.next_power_of_2(n)))
        _silu_and_mul_quant_kernel[(num_tokens, triton.cdiv(n, block))](
            x, q, scales, n, groups, GROUP=group, BLOCK=block, num_warps=min(16, max(4, block // 512)),
            **pdl_launch(x))
    return QuantizedActivation(q, scales, x.dtype)
