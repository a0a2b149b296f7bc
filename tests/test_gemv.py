"""The weight-streaming GEMV of float8 weights against its torch twin (Triton's interpreter on the
CPU in float32/float16; bfloat16 and float16 on CUDA): odd N, K not a multiple of the step, groups
of 128, 64 and 32, 1 to 16 rows, split K and bias; the twin against the dequantized weight."""
import pytest
import torch

from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX
from nanovllm.kernels.fp8_gemv import FEW_ROWS_CONFIG, ONE_ROW_CONFIG, GemvConfig, fp8_gemv, fp8_gemv_ref
from nanovllm.kernels.fp8_linear import dequantize_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]
ROWS = [1, 2, 3, 8, 13, 16]
# small steps so the interpreter's shapes cover several steps, a partial one and split K
SMALL = GemvConfig(16, 64, 4, 2)


def close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Same products, float32 sums in another order, one rounding to the output dtype."""
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[ref.dtype]
    assert y.dtype == ref.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def fp8_weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = torch.rand(n, -(-k // group), generator=g) * 0.01 + 0.001
    return q.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, group, bias", [
    (37, 200, 200, True),       # per-channel, odd N, K not a multiple of the step
    (41, 320, 128, False),      # block scales of 128 columns, the last group partial
    (24, 448, 64, True),        # groups of 64
])
def test_fp8_gemv_matches_twin(dtype, rows, n, k, group, bias):
    w_q, w_s = fp8_weight(n, k, group, seed=n + k)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2).to(DEVICE, dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) if bias else None
    close(fp8_gemv(x, w_q, w_s, group, b), fp8_gemv_ref(x, w_q, w_s, group, b))


@pytest.mark.parametrize("config", [ONE_ROW_CONFIG, FEW_ROWS_CONFIG, SMALL, GemvConfig(32, 32, 2, 1)])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("rows", [1, 6])
def test_fp8_gemv_launch_shapes_and_split_k_agree(config, split_k, rows):
    n, k, group = 50, 384, 128
    w_q, w_s = fp8_weight(n, k, group, seed=3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPES[0])
    b = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(DEVICE, DTYPES[0])
    close(fp8_gemv(x, w_q, w_s, group, b, config=config, split_k=split_k), fp8_gemv_ref(x, w_q, w_s, group, b))


def test_fp8_gemv_reads_a_strided_activation_and_rejects_bad_groups():
    w_q, w_s = fp8_weight(16, 256, 128, seed=5)
    x = torch.randn(3, 300).to(DEVICE, DTYPES[0])[:, :256]     # rows 300 apart, columns contiguous
    close(fp8_gemv(x, w_q, w_s, 128), fp8_gemv_ref(x, w_q, w_s, 128))
    with pytest.raises(ValueError, match="group_size"):
        fp8_gemv(x, w_q, torch.ones(16, 3, device=DEVICE), 96)


def test_fp8_gemv_twin_is_the_dequantized_weight_with_unquantized_activations():
    w_q, w_s = fp8_weight(8, 256, 128, seed=6)
    x = torch.randn(2, 256, dtype=torch.float64).to(DEVICE)
    expected = x @ dequantize_ref(w_q, w_s, 128).double().T
    torch.testing.assert_close(fp8_gemv_ref(x.float(), w_q, w_s, 128).double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="the GEMVs serve only CUDA; the CPU keeps the twins")
def test_fp8_method_takes_the_gemv_up_to_its_row_limit():
    """The FP8 linear method: the 16-bit-activation GEMV up to GEMV_MAX_ROWS rows (float8 activations
    would round x to 3 mantissa bits), the W8A8 GEMM above."""
    from nanovllm.kernels.fp8_linear import fp8_matmul_ref, quantize_activation_ref
    from nanovllm.quantization.fp8 import GEMV_MAX_ROWS, Fp8LinearMethod
    k, n = 512, 96
    w_q, w_s = fp8_weight(n, k, 128, seed=11)
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
        y = Fp8LinearMethod().multiply(x, w_q, w_s, 128)
        if rows <= GEMV_MAX_ROWS:
            close(y, fp8_gemv_ref(x, w_q, w_s, 128))
        else:
            close(y, fp8_matmul_ref(*quantize_activation_ref(x, 128), w_q, w_s, 128, torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("n, k, group, bias", [(2 * 37, 200, 200, True), (2 * 40, 320, 128, False)])
def test_fp8_gemv_gated_is_the_product_then_silu_and_mul(dtype, rows, n, k, group, bias):
    """gated=True: silu(gate) * up from the epilogue, bit for bit the unfused GEMV followed by the
    silu_and_mul kernel (both round where the 16-bit layer would), and close to the twins."""
    from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
    w_q, w_s = fp8_weight(n, k, group, seed=n + k)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2).to(DEVICE, dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype) if bias else None
    for config in (ONE_ROW_CONFIG if rows == 1 else FEW_ROWS_CONFIG, SMALL):
        fused = fp8_gemv(x, w_q, w_s, group, b, config=config, split_k=1, gated=True)
        assert fused.shape == (rows, n // 2) and fused.dtype == dtype
        torch.testing.assert_close(fused, silu_and_mul(fp8_gemv(x, w_q, w_s, group, b, config=config, split_k=1)),
                                   rtol=0, atol=0)
        close(fused, silu_and_mul_ref(fp8_gemv_ref(x, w_q, w_s, group, b)))
    assert fp8_gemv(x, w_q, w_s, group, b, config=SMALL, split_k=2, gated=True) is None   # split sums: no epilogue
