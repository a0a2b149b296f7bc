"""The few-row weight-streaming kernels (float8 weights, and 4/8-bit packed weights) against their
torch twins (Triton's interpreter on the CPU in float32/float16; bfloat16 and float16 on CUDA):
odd N, K not a multiple of the step, groups of 128, 64 and 32, 1 to 16 rows, split K and bias; the
twins against the formats' own dequantizers."""
import pytest
import torch

from nanovllm.kernels.fp8 import FP8_DTYPE, FP8_MAX
from nanovllm.kernels.fp8_gemv import FEW_ROWS_CONFIG, ONE_ROW_CONFIG, GemvConfig, fp8_gemv, fp8_gemv_ref
from nanovllm.kernels.fp8_linear import dequantize_ref
from nanovllm.kernels.int_gemm import int_gemm_ref
from nanovllm.kernels.int_gemv import gemv_supported, int_gemv, int_gemv_ref
from nanovllm.quantization.int_packing import awq_for_gemm, dequantize_awq, dequantize_gptq, gptq_for_gemm
from nanovllm.utils.quantized_checkpoint import quantize_awq, quantize_gptq

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


def random_packed(k: int, n: int, group: int, bits: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The GEMM layout with any N (the checkpoint formats need N a multiple of 8; the layout does not)."""
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k * bits // 32, n), dtype=torch.int32, generator=g)
    scales = torch.rand(-(-k // group), n, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 1 << bits, scales.shape, generator=g) * scales
    return {"qweight": qweight.to(DEVICE), "scales": scales.to(DEVICE, dtype), "scaled_zeros": zeros.to(DEVICE, dtype)}


def int_args(layer, bits, group):
    return layer["qweight"], layer["scales"], layer["scaled_zeros"], bits, group


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits, n, k, group", [
    (4, 37, 384, 128),      # odd N, three groups of 128
    (4, 72, 320, 64),       # groups of 64
    (8, 19, 200, 200),      # 8 bits, one group over K, K not a multiple of the step
    (4, 40, 256, 32),       # steps smaller than the default
])
def test_int_gemv_matches_twin(dtype, rows, bits, n, k, group):
    layer = random_packed(k, n, group, bits, dtype, seed=n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    close(int_gemv(x, *int_args(layer, bits, group)), int_gemv_ref(x, *int_args(layer, bits, group)))


@pytest.mark.parametrize("config", [GemvConfig(64, 128, 4, 4), SMALL, GemvConfig(128, 256, 8, 3)])
@pytest.mark.parametrize("split_k", [1, 2, 5])
@pytest.mark.parametrize("rows", [1, 9])
def test_int_gemv_launch_shapes_and_split_k_agree(config, split_k, rows):
    k, n, group = 512, 45, 128
    layer = random_packed(k, n, group, 4, DTYPES[0], seed=9)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).to(DEVICE, DTYPES[0])
    close(int_gemv(x, *int_args(layer, 4, group), config=config, split_k=split_k),
          int_gemv_ref(x, *int_args(layer, 4, group)))


@pytest.mark.parametrize("fmt, bits, group", [("awq", 4, 128), ("awq", 4, 64), ("gptq", 4, 128), ("gptq", 8, 64)])
def test_int_gemv_multiplies_by_the_checkpoint_weight(fmt, bits, group):
    k, n = 256, 48
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(bits)) / k ** 0.5
    if fmt == "awq":
        t = quantize_awq(w, group)
        layer = awq_for_gemm(t["qweight"], t["qzeros"], t["scales"], torch.float32)
        weight = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], group)
    else:
        t = quantize_gptq(w, bits, group, None)
        layer = gptq_for_gemm(t["qweight"], t["qzeros"], t["scales"], bits, True, torch.float32)
        weight = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1))
    ref = int_gemv_ref(x, *int_args(layer, bits, group))
    torch.testing.assert_close(ref, x @ weight.t(), rtol=0, atol=1e-5)
    layer = {name: t.to(DEVICE) for name, t in layer.items()}
    dtype = DTYPES[-1]
    layer16 = {name: t.to(dtype) if t.is_floating_point() else t for name, t in layer.items()}
    x16 = x.to(DEVICE, dtype)
    close(int_gemv(x16, *int_args(layer16, bits, group)), int_gemv_ref(x16, *int_args(layer16, bits, group)))
    # the same product as the many-row kernel's twin, which rounds the weight to x's dtype first
    ref16 = int_gemm_ref(x16, *int_args(layer16, bits, group)).float()
    torch.testing.assert_close(int_gemv(x16, *int_args(layer16, bits, group)).float(), ref16,
                               rtol=2e-2, atol=2e-2 * ref16.abs().max().item())


def test_act_order_and_odd_groups_are_left_to_int_gemm():
    g_idx = torch.randperm(256, generator=torch.Generator().manual_seed(0)) // 128   # act order: groups not runs
    assert gemv_supported(256, 128, None) and gemv_supported(256, 32, None) and gemv_supported(200, 200, None)
    assert not gemv_supported(256, 128, g_idx)
    assert not gemv_supported(240, 24, None)        # no step of >= 16 rows inside one group of 24
    layer = random_packed(240, 16, 24, 4, DTYPES[0], seed=1)
    with pytest.raises(ValueError, match="group_size"):
        int_gemv(torch.randn(1, 240).to(DEVICE, DTYPES[0]), *int_args(layer, 4, 24))


@pytest.mark.skipif(DEVICE != "cuda", reason="the GEMVs serve only CUDA; the CPU keeps the twins")
def test_linear_layers_take_the_gemv_up_to_its_row_limit():
    """fp8_linear and the weight-only layers: the 16-bit-activation GEMV up to GEMV_MAX_ROWS rows
    (float8 activations would round x to 3 mantissa bits), the W8A8 GEMM and int_gemm above."""
    from torch import nn

    from nanovllm.kernels import fp8_gemv as fp8_gemv_module
    from nanovllm.kernels import int_gemv as int_gemv_module
    from nanovllm.kernels.fp8_linear import fp8_linear, fp8_matmul_ref, quantize_activation_ref
    from nanovllm.quantization.awq import AWQLinearMethod
    k, n = 512, 96
    w_q, w_s = fp8_weight(n, k, 128, seed=11)
    for rows in (1, fp8_gemv_module.GEMV_MAX_ROWS, fp8_gemv_module.GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
        y = fp8_linear(x, w_q, w_s, 128)
        if rows <= fp8_gemv_module.GEMV_MAX_ROWS:
            close(y, fp8_gemv_ref(x, w_q, w_s, 128))
        else:
            close(y, fp8_matmul_ref(*quantize_activation_ref(x, 128), w_q, w_s, 128, torch.bfloat16))
    t = quantize_awq(torch.randn(n, k, generator=torch.Generator().manual_seed(2)) / k ** 0.5, 128)
    layer, method = nn.Module(), AWQLinearMethod(128)
    for name, tensor in t.items():
        setattr(layer, name, nn.Parameter(tensor.to(DEVICE), requires_grad=False))
    layer.params_dtype = torch.bfloat16
    method.process_weights_after_loading(layer)
    args = (layer.qweight, layer.scales, layer.scaled_zeros, 4, 128)
    for rows in (1, int_gemv_module.GEMV_MAX_ROWS):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
        y = method.apply(layer, x)
        assert torch.equal(y, int_gemv(x, *args)), rows
        close(y, int_gemv_ref(x, *args))
