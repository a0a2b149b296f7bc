"""RMSNorm, optionally fused with the residual add before it (one pass over the hidden states).

Rounds like Hugging Face's RMSNorm layers: normalise in float32, round to the input dtype, then scale.
"""
import torch

from nanovllm.kernels.triton_compat import pdl_launch, tl, triton, wait_for_previous_kernel


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, eps, num_rows, stride_x_row, stride_x_head,
                     NUM_HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    # ROWS rows per program, each a (token, head) pair; heads only for the per-head q/k norms
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x_offs = ((rows // NUM_HEADS) * stride_x_row + (rows % NUM_HEADS) * stride_x_head)[:, None] + cols[None, :]
    own_offs = rows[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + own_offs, mask=mask, other=0.0)
        tl.store(residual_ptr + own_offs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 1) / N + eps)[:, None]
    w = tl.load(weight_ptr + cols, mask=cols < N)
    out = w.to(tl.float32)[None, :] * h.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + own_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, N] or a per-head view [tokens, heads, N]; residual (if any) is updated in place."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    assert x3.stride(2) == 1 and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
    num_tokens, num_heads, n = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    rows = max(1, 2048 // block)          # short rows (head_dim) are normalised several per program
    num_rows = num_tokens * num_heads
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x3, residual if residual is not None else x3, weight, out, eps, num_rows, x3.stride(0), x3.stride(1),
        NUM_HEADS=num_heads, N=n, BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None,
        num_warps=4 if block * rows <= 2048 else 8, **pdl_launch(x))
    return out if residual is None else (out, residual)
