"""RMSNorm, optionally fused with the residual add before it (one pass over the hidden states).

Rounds like Hugging Face's Qwen3RMSNorm: normalise in float32, round to the input dtype, then scale.
"""
import torch

from nanovllm.kernels.triton_compat import tl, triton


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
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, eps, stride_x_row, stride_x_head,
                     NUM_HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)                       # one (token, head) row; heads only for q/k norms
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x_offs = (row // NUM_HEADS) * stride_x_row + (row % NUM_HEADS) * stride_x_head + offs
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * N + offs, mask=mask, other=0.0)
        tl.store(residual_ptr + row * N + offs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(weight_ptr + offs, mask=mask)
    out = w.to(tl.float32) * h.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, N] or a per-head view [tokens, heads, N]; residual (if any) is updated in place."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    assert x3.stride(2) == 1 and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
    num_tokens, num_heads, n = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(num_tokens * num_heads,)](
        x3, residual if residual is not None else x3, weight, out, eps, x3.stride(0), x3.stride(1),
        NUM_HEADS=num_heads, N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
        num_warps=4 if n <= 1024 else 8)
    return out if residual is None else (out, residual)
