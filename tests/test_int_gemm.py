"""The weight-only integer GEMM kernel against its torch twin (interpreter on the CPU, float16 and
float32; float16 and bfloat16 on CUDA, where the engine runs float32 through the twin), for both
launch shapes, odd row counts and group sizes, 4 and 8 bits, and act-order group indices; the twin
against the formats' own dequantizers."""
import pytest
import torch

from nanovllm.kernels.int_gemm import (DECODE_CONFIG, SWAPPED_CONFIGS, LaunchConfig, int_gemm,
                                       int_gemm_ref, launch_config)
from nanovllm.quantization.int_packing import awq_for_gemm, dequantize_awq, dequantize_gptq, gptq_for_gemm
from nanovllm.checkpoints.quantized_checkpoint import act_order, quantize_awq, quantize_gptq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]
WIDE = torch.float16 if DEVICE == "cuda" else torch.float32     # the most precise dtype the kernel takes here


def packed_layer(fmt: str, k: int, n: int, group_size: int, bits: int = 4, desc_act: bool = False,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    if fmt == "awq":
        t = quantize_awq(w, group_size)
        return awq_for_gemm(t["qweight"], t["qzeros"], t["scales"], dtype), None, \
            dequantize_awq(t["qweight"], t["qzeros"], t["scales"], group_size)
    t = quantize_gptq(w, bits, group_size, act_order("layer.weight", k) if desc_act else None)
    g_idx = t["g_idx"] if desc_act else None
    return gptq_for_gemm(t["qweight"], t["qzeros"], t["scales"], bits, True, dtype, act_order=desc_act), g_idx, \
        dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)


def run_both(x, layer, bits, group_size, g_idx, config=None):
    to = {name: t.to(DEVICE) for name, t in layer.items()}
    g = g_idx.to(DEVICE) if g_idx is not None else None
    args = (to["qweight"], to["scales"], to["scaled_zeros"], bits, group_size, g)
    return int_gemm(x, *args, config=config), int_gemm_ref(x, *args)


def tolerance(dtype):
    return dict(rtol=0, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 200, 600])     # every default launch shape
def test_awq_layout_matches_twin(dtype, rows):
    k, n, group_size = 256, 72, 64
    layer, g_idx, _ = packed_layer("awq", k, n, group_size, dtype=dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    out, ref = run_both(x, layer, 4, group_size, g_idx)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("bits,group_size,desc_act", [(4, 32, False), (4, 128, True), (8, 64, False),
                                                      (8, 32, True), (4, 256, False)])
@pytest.mark.parametrize("rows", [2, 33])
def test_gptq_layout_matches_twin(bits, group_size, desc_act, rows):
    k, n = 256, 40
    layer, g_idx, _ = packed_layer("gptq", k, n, group_size, bits, desc_act, dtype=torch.float16, seed=bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.float16)
    for unpack_by_reshape in (True, False):
        config = launch_config(rows)._replace(unpack_by_reshape=unpack_by_reshape)
        out, ref = run_both(x, layer, bits, group_size, g_idx, config)
        torch.testing.assert_close(out, ref, **tolerance(torch.float16))


@pytest.mark.parametrize("config", [DECODE_CONFIG, *(c for _, c in SWAPPED_CONFIGS),
                                    LaunchConfig(16, 32, 32, 3, 4, 2, False), LaunchConfig(32, 16, 16, 1, 4, 2, False),
                                    LaunchConfig(16, 16, 64, 2, 4, 2, True),
                                    LaunchConfig(16, 16, 16, 3, 4, 2, False, True),
                                    SWAPPED_CONFIGS[-1][1]._replace(swapped=False)])
def test_every_launch_shape_agrees(config):
    """Split-K (atomic float32 partial sums) and single-program K loops, tiles smaller than a group,
    plain and swapped (out^T = W^T x^T)."""
    k, n, group_size = 192, 48, 32
    layer, g_idx, _ = packed_layer("awq", k, n, group_size)
    layer = {name: t.to(WIDE) if t.is_floating_point() else t for name, t in layer.items()}
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, WIDE)
    out, ref = run_both(x, layer, 4, group_size, g_idx, config=config)
    torch.testing.assert_close(out, ref, **tolerance(WIDE))


@pytest.mark.parametrize("config", [DECODE_CONFIG, SWAPPED_CONFIGS[0][1], LaunchConfig(16, 16, 64, 2, 4, 2, True),
                                    LaunchConfig(16, 32, 32, 1, 4, 2, False)])
def test_layers_in_step_order_match_twin(config):
    """4-bit layers in groups of whole steps (the layout's step order), unpacked by reshape or per row,
    tiles of whole, half and quarter steps."""
    layer, g_idx, _ = packed_layer("awq", 256, 40, 128, dtype=WIDE)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).to(DEVICE, WIDE)
    out, ref = run_both(x, layer, 4, 128, g_idx, config=config)
    torch.testing.assert_close(out, ref, **tolerance(WIDE))


# group 128 without act order: the layout's step order
@pytest.mark.parametrize("fmt,bits,desc_act,group_size", [("awq", 4, False, 32), ("gptq", 4, True, 32),
                                                          ("gptq", 8, False, 32), ("awq", 4, False, 128),
                                                          ("gptq", 4, False, 128)])
def test_twin_multiplies_by_the_dequantized_checkpoint_weight(fmt, bits, desc_act, group_size):
    k, n = 256, 32
    layer, g_idx, weight = packed_layer(fmt, k, n, group_size, bits, desc_act)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1))
    ref = int_gemm_ref(x, layer["qweight"], layer["scales"], layer["scaled_zeros"], bits, group_size, g_idx)
    torch.testing.assert_close(ref, x @ weight.t(), rtol=0, atol=1e-5)
