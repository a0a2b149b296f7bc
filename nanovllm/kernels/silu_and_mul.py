"""SwiGLU's activation: silu(gate) * up, with gate and up side by side in one tensor."""
import torch
import torch.nn.functional as F

from nanovllm.kernels.triton_compat import pdl_launch, tl, triton, wait_for_previous_kernel


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    gate = tl.load(x_ptr + row * 2 * N + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * N + N + col, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)     # round like torch's silu before the product
    tl.store(out_ptr + row * N + col, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, 2 * N] contiguous -> [tokens, N]."""
    assert x.is_contiguous()
    num_tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, block))](x, out, N=n, BLOCK=block, **pdl_launch(x))
    return out
