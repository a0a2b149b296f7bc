"""Prefills with integer weights: the dequantizing kernel writes exactly the twin's weight (q * s - z
in float32, rounded once to the activation dtype) for AWQ at 4 bits and GPTQ at 4 and 8 bits with
act-order group indices and partial tiles (interpreter on the CPU, CUDA there); the product on it
matches int_gemm's twin; the scratch buffer grows to the largest layer and is reused; the
weight-only layer sends DEQUANTIZE_FROM_ROWS rows and more there on CUDA."""
import pytest
import torch

from nanovllm.kernels import int_dequantize
from nanovllm.kernels.int_dequantize import DEQUANTIZE_FROM_ROWS, dequantize, dequantized_matmul
from nanovllm.kernels.int_gemm import dequantize_packed, int_gemm_ref
from tests.test_int4_gemv import assert_layer_routes
from tests.test_int_gemm import DEVICE, DTYPES, packed_layer, tolerance


def on_device(layer: dict, g_idx):
    return {name: t.to(DEVICE) for name, t in layer.items()}, g_idx.to(DEVICE) if g_idx is not None else None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,bits,group_size,desc_act", [("awq", 4, 128, False), ("gptq", 4, 64, True),
                                                           ("gptq", 8, 128, True), ("gptq", 8, 256, False)])
def test_weight_is_the_twins(dtype, fmt, bits, group_size, desc_act):
    k, n = 256, 200        # 200 columns: a partial column tile
    layer, g_idx = on_device(*packed_layer(fmt, k, n, group_size, bits, desc_act, dtype=dtype)[:2])
    args = (layer["qweight"], layer["scales"], layer["scaled_zeros"], bits, group_size, g_idx)
    weight = dequantize(*args)
    assert weight.shape == (k, n) and weight.dtype == dtype
    assert torch.equal(weight, dequantize_packed(*args).to(dtype))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    torch.testing.assert_close(dequantized_matmul(x, *args), int_gemm_ref(x, *args), **tolerance(dtype))


def test_scratch_grows_to_the_largest_layer_and_is_reused():
    dtype = DTYPES[0]
    small, _ = on_device(*packed_layer("awq", 128, 64, 128, dtype=dtype)[:2])
    large, _ = on_device(*packed_layer("awq", 256, 96, 128, dtype=dtype, seed=1)[:2])
    args = lambda layer: (layer["qweight"], layer["scales"], layer["scaled_zeros"], 4, 128)
    dequantize(*args(large))
    buffer = int_dequantize._scratch[(large["qweight"].device, dtype)]
    assert buffer.numel() >= 256 * 96
    small_weight = dequantize(*args(small))
    assert small_weight.data_ptr() == buffer.data_ptr()
    assert torch.equal(small_weight, dequantize_packed(*args(small)).to(dtype))


@pytest.mark.skipif(DEVICE != "cuda", reason="the layer sends work to the Triton kernels on CUDA only")
@pytest.mark.parametrize("rows,expect", [(DEQUANTIZE_FROM_ROWS - 1, False), (DEQUANTIZE_FROM_ROWS, True)])
def test_weight_only_layer_routes_prefills_to_the_dequantized_weight(monkeypatch, rows, expect):
    assert_layer_routes(monkeypatch, "dequantized_matmul", rows, expect)
