"""The float8 linear kernels against their torch twins (Triton's interpreter on the CPU in
float32/float16; bfloat16 on CUDA), and the twins against plain float math."""
import pytest
import torch

from nanovllm.kernels.fp8 import FP8_DTYPE, FP8_MAX
from nanovllm.kernels.fp8_linear import (dequantize_ref, fp8_matmul, fp8_matmul_ref, quantize_activation,
                                         quantize_activation_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]


def weight(n: int, k: int, group: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=generator)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=generator) * 0.01 + 0.001
    q = (w * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.to(DEVICE), scale.to(DEVICE)


def test_activation_twin_is_max_abs_over_448_per_token_group():
    x = torch.randn(3, 200) * torch.tensor([[1.0], [30.0], [0.0]])
    q, s = quantize_activation_ref(x, 128)
    assert s.shape == (3, 2)
    assert torch.allclose(s[1, 0], x[1, :128].abs().max() / FP8_MAX)
    assert torch.allclose(s[1, 1], x[1, 128:].abs().max() / FP8_MAX)
    assert (s[2] > 0).all() and (q[2].float() == 0).all()          # a zero token stays zero, no NaN
    assert q.float().abs().amax(dim=1)[:2].eq(FP8_MAX).all()      # each token's largest maps to 448
    assert torch.allclose(dequantize_ref(q, s, 128), x, rtol=2 ** -4, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, group", [(1, 64, 64), (5, 200, 128), (33, 256, 128), (4, 96, 96)])
def test_activation_kernel_matches_twin(dtype, m, k, group):
    x = (torch.randn(m, k) * 3).to(dtype).to(DEVICE)
    q, s = quantize_activation(x, group)
    q_ref, s_ref = quantize_activation_ref(x, group)
    torch.testing.assert_close(s, s_ref)
    # the same float32 division, rounded to e4m3 the same way: the same bits
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_static_activation_scale_is_used_as_is():
    x = torch.randn(4, 64).to(DEVICE)
    scale = torch.tensor([0.05], device=DEVICE)
    q, s = quantize_activation(x, 64, static_scale=scale)
    q_ref, s_ref = quantize_activation_ref(x, 64, static_scale=scale)
    assert s.shape == (4, 1) and torch.all(s == 0.05)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, group, bias", [
    (1, 64, 128, 128, False),       # per-channel, decode
    (7, 96, 160, 160, True),        # per-channel, K not a power of two, bias
    (3, 64, 256, 128, False),       # block: two groups
    (40, 80, 320, 128, True),       # block: last group partial, tiles partial
    (20, 64, 128, 32, False),       # group smaller than a tile step
])
def test_gemm_matches_twin(dtype, m, n, k, group, bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype).to(DEVICE)
    w_q, w_s = weight(n, k, group, g)
    x_q, x_s = quantize_activation_ref(x, group)
    b = (torch.randn(n, generator=g)).to(dtype).to(DEVICE) if bias else None
    y = fp8_matmul(x_q, x_s, w_q, w_s, group, dtype, b)
    y_ref = fp8_matmul_ref(x_q, x_s, w_q, w_s, group, dtype, b)
    assert y.dtype == dtype and y.shape == (m, n)
    # same float8 products, float32 sums in another order; then one rounding to dtype
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol * y_ref.float().abs().max().item())


def test_twin_equals_the_float_product_of_the_dequantized_operands():
    g = torch.Generator().manual_seed(0)
    w_q, w_s = weight(16, 256, 128, g)
    x = torch.randn(3, 256, generator=g).to(DEVICE)
    x_q, x_s = quantize_activation_ref(x, 128)
    expected = sum((x_q[:, i:i + 128].double() @ w_q[:, i:i + 128].double().T) * x_s[:, i // 128, None].double()
                   * w_s[None, :, i // 128].double() for i in (0, 128))
    torch.testing.assert_close(fp8_matmul_ref(x_q, x_s, w_q, w_s, 128, torch.float32), expected.float(),
                               rtol=1e-5, atol=1e-5)
