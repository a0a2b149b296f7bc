"""RMSNorm, optionally fused with the residual add before it (one pass over the hidden states).

Rounds like Hugging Face's RMSNorm layers: normalise in float32, round to the input dtype, then scale.

`rms_norm_quant` writes the output quantized to float8 for an FP8 linear layer instead (with its scales,
per token or per token and group): the bits `quantize_activation_ref` gives for the 16-bit output.

With a residual, x may also be the float32 sums a split reduction left unfinished (PendingSums): the
norm rounds them to the residual's dtype, as the reduction would have, and clears them.
"""
import torch

from nanovllm.kernels.fp8_primitives import FP8_DTYPE
from nanovllm.kernels.fp8_linear import QuantizedActivation, num_groups, quantize_activation_ref, quantize_groups
from nanovllm.kernels.triton_compat import pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel
from nanovllm.kernels.zeroed_workspace import PendingSums


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                       residual: torch.Tensor | None = None):
    """The torch twin of `rms_norm_quant`: the 16-bit norm, then the activation quantization."""
    out = rms_norm_ref(x, weight, eps, residual)
    normed = out if residual is None else out[0]
    quantized = QuantizedActivation(*quantize_activation_ref(normed, group_size), normed.dtype)
    return quantized if residual is None else (quantized, out[1])


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr, eps, num_rows, stride_x_row,
                     stride_x_head, NUM_HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr,
                     ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT_GROUP: tl.constexpr,
                     NUM_GROUPS: tl.constexpr, PDL: tl.constexpr, PENDING_SUMS: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    # ROWS rows per program, each a (token, head) pair; heads only for the per-head q/k norms
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    x_offs = ((rows // NUM_HEADS) * stride_x_row + (rows % NUM_HEADS) * stride_x_head)[:, None] + cols[None, :]
    own_offs = rows[:, None] * N + cols[None, :]
    # every load first: one issued after the row's sum (which waits for every warp) or after a store
    # (which may alias it) waits out its whole latency there
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + own_offs, mask=mask, other=0.0)
    if PENDING_SUMS:    # float32 sums in the workspace: rounded as the reduction would, then cleared
        # every warp has read its sums before any clears them: Triton may store in another thread
        # layout than it loaded (it does for 4,096 columns), and then a warp clears what another reads
        tl.debug_barrier()
        tl.store(x_ptr + x_offs, tl.zeros_like(x), mask=mask)
        x = x.to(residual_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        x = x + residual
        tl.store(residual_ptr + own_offs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 1) / N + eps)[:, None]
    out = w.to(tl.float32)[None, :] * h.to(x.dtype).to(tl.float32)
    if QUANT_GROUP == 0:
        tl.store(out_ptr + own_offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:   # float8 out, one scale per row and QUANT_GROUP columns (the padding columns are zeros)
        q, scale = quantize_groups(out.to(x.dtype).to(tl.float32), ROWS, BLOCK, QUANT_GROUP)
        tl.store(out_ptr + own_offs, q.to(tl.float8e4nv), mask=mask)
        group_ids = tl.arange(0, BLOCK // QUANT_GROUP)
        tl.store(scale_ptr + rows[:, None] * NUM_GROUPS + group_ids[None, :], scale,
                 mask=(rows < num_rows)[:, None] & (group_ids < NUM_GROUPS)[None, :])


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            out: torch.Tensor, scales: torch.Tensor | None, quant_group: int, pending_sums: bool = False) -> None:
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    assert x3.stride(2) == 1 and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
    num_tokens, num_heads, n = x3.shape
    block = triton.next_power_of_2(n)
    rows = max(1, 2048 // block)          # short rows (head_dim) are normalised several per program
    num_rows = num_tokens * num_heads
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x3, residual if residual is not None else x3, weight, out, scales if scales is not None else out, eps,
        num_rows, x3.stride(0), x3.stride(1), NUM_HEADS=num_heads, N=n, BLOCK=block, ROWS=rows,
        HAS_RESIDUAL=residual is not None, QUANT_GROUP=min(quant_group, block),
        NUM_GROUPS=scales.shape[1] if scales is not None else 1, PENDING_SUMS=pending_sums,
        num_warps=4 if block * rows <= 2048 else 8, **pdl_launch(x))


def rms_norm(x: torch.Tensor | PendingSums, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, N] or a per-head view [tokens, heads, N], or PendingSums [tokens, N] with a
    residual; residual (if any) is updated in place."""
    pending_sums = isinstance(x, PendingSums)
    if pending_sums:
        assert residual is not None and residual.dtype == x.dtype
        x = x.sums
    out = torch.empty(x.shape, dtype=residual.dtype if pending_sums else x.dtype, device=x.device)
    _launch(x, weight, eps, residual, out, None, 0, pending_sums)
    return out if residual is None else (out, residual)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                   residual: torch.Tensor | None = None):
    """rms_norm of x [tokens, N] quantized to float8 per token and `group_size` columns (a power of
    two, or N or more: per token) -> QuantizedActivation (and the 16-bit residual, updated in place)."""
    m, n = x.shape
    assert group_size >= n or group_size & (group_size - 1) == 0
    q = torch.empty(m, n, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, num_groups(n, group_size), dtype=torch.float32, device=x.device)
    if m:
        _launch(x, weight, eps, residual, q, scales, group_size if group_size < n else triton.next_power_of_2(n))
    quantized = QuantizedActivation(q, scales, x.dtype)
    return quantized if residual is None else (quantized, residual)
