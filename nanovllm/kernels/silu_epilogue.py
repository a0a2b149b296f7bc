"""SwiGLU's activation in the epilogue of a GEMV over a merged [gate; up] weight.

A program of such a GEMV computes a run of gate columns and the same run of up columns (the first
and the second half of its tile), so it holds both operands of silu(gate) * up and can store the
activation instead of the product: one kernel and one round trip of gate and up less per layer.
The values are rounded where the unfused layer's output and silu_and_mul round, so the activation
has the same bits as the two kernels' result.
"""
from nanovllm.kernels.triton_compat import tl, triton


@triton.jit
def silu_and_mul_store(out_ptr, acc, rows, first_col, M, HALF_N, BLOCK_N: tl.constexpr):
    """acc [R, BLOCK_N] float32: gate columns first_col.. then the same columns of up; stores
    silu(gate) * up at those columns of out [M, HALF_N] for the rows below M."""
    dtype = out_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, BLOCK_N // 2)), (0, 2, 1)))
    gate = gate.to(dtype).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    cols = first_col + tl.arange(0, BLOCK_N // 2)
    tl.store(out_ptr + rows[:, None] * HALF_N + cols[None, :], y.to(dtype),
             mask=(rows < M)[:, None] & (cols < HALF_N)[None, :])


@triton.jit
def gated_columns(pid_n, HALF_N, BLOCK_N: tl.constexpr):
    """The weight columns (or rows) of program pid_n's tile: BLOCK_N // 2 gate ones, then the same
    ones of up, HALF_N further; and which of them exist."""
    i = tl.arange(0, BLOCK_N)
    j = pid_n * (BLOCK_N // 2) + i % (BLOCK_N // 2)
    return j + (i // (BLOCK_N // 2)) * HALF_N, j < HALF_N
