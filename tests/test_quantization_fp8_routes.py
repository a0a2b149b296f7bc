"""Which kernel an FP8 linear layer multiplies with, per call (Fp8LinearMethod.route in
nanovllm/quantization/fp8.py), for each weight layout, row count, device and dtype.

The tables are the routes of the code before the choice moved out of nanovllm/kernels/fp8_linear.py
(`fp8_linear`, `takes_gemv`, `fp8_gemm` and `decode_tile` at b0139b2), worked out by reading it and
written here literally, so a change of route shows up as a change of this file; the transposed tiles
of up to 128 rows are those of the 2026-12-03 sweep (split K, seven stages). The device is faked
(the CPU has none), so the choice is read without running a GPU kernel; the last test checks that
`apply` runs the chosen kernel with the chosen tile.
"""
import pytest
import torch
from torch import nn

import nanovllm.quantization.fp8 as fp8_methods
from nanovllm.kernels.fp8_linear import MULTI_WAVE_TILE, GemmTile
from nanovllm.kernels.fp8_primitives import FP8_DTYPE, QuantizedActivation
from nanovllm.quantization.fp8 import (CudaDevice, Fp8BlockLinearMethod, Fp8ChannelLinearMethod, Fp8LinearMethod,
                                       Fp8OnlineLinearMethod, Fp8Route, Fp8TensorLinearMethod)

H100 = CudaDevice(sms=132, major_capability=9)
A100 = CudaDevice(sms=108, major_capability=8)
INPUTS = 256    # two 128-column blocks: block scales have two groups a row (K splits only two-piece tiles),
                # too short a row of block scales for cuBLASLt (whole_blocks: the last test)

GEMV, GEMM, SCALED_MM, TWIN = Fp8Route("gemv"), Fp8Route("gemm"), Fp8Route("scaled_mm"), Fp8Route("twin")


def transposed(block_m: int, block_n: int, num_warps: int, num_stages: int, split_k: int = 1) -> Fp8Route:
    return Fp8Route("transposed", GemmTile(block_m, block_n, 128, num_warps, num_stages, split_k, True))


# Up to 128 rows, 64 features by the rows rounded up to a power of two: 4096 features (64 tiles on an
# H100's 132 SMs) split K in two, 6144 do not, both in seven stages; 24576 (several waves) in five
# stages up to 32 rows, three above; block scales at up to 16 rows keep gemm_tile's tile (GEMM) there
O16, O32, O64, O128 = (transposed(rows, 64, 4, 7, 2) for rows in (16, 32, 64, 128))
Q16, Q32, Q64, Q128 = (transposed(rows, 64, 4, 7) for rows in (16, 32, 64, 128))
G16, G32, G64, G128 = transposed(16, 64, 4, 5), transposed(32, 64, 4, 5), transposed(64, 64, 4, 3), \
    transposed(128, 64, 4, 3)
# past 128 rows
T128_5, T128x128 = transposed(128, 64, 4, 5), transposed(128, 128, 8, 5)
T256 = transposed(256, 64, 8, 5)
assert T256.tile == MULTI_WAVE_TILE
# 129-192 rows of per-channel products: 128 rows and a second piece of the rest rounded up to a power of
# two, where two_piece_tile has a tile (qkv and gate_up; o's 4096 features keep two 128-row tiles)
Q144, Q160, Q192 = (Fp8Route("transposed", GemmTile(128, 64, 128, 4, 5, 1, True, extra)) for extra in (16, 32, 64))
G144, G160 = (Fp8Route("transposed", GemmTile(128, 128, 128, 8, 3, 1, True, extra)) for extra in (16, 32))
G192 = Fp8Route("transposed", GemmTile(128, 64, 128, 4, 5, 1, True, 64))
# with block scales, 129-160 rows (two_piece_block_tile): 64 features, three stages, K split in two
# for a second piece of 16 rows (these INPUTS are too few for down_proj's split in three)
B144, B160 = (Fp8Route("transposed", GemmTile(128, 64, 128, 4, 3, split, True, extra))
              for split, extra in ((2, 16), (1, 32)))

# layout -> (a method of that layout, the column of the tables below it reads): per-channel, online
# and per-tensor dynamic scales all become one scale a row, with activations quantized per token
LAYOUTS = {
    "per-channel": (Fp8ChannelLinearMethod, 0),
    "online": (Fp8OnlineLinearMethod, 0),
    "per-tensor": (lambda: Fp8TensorLinearMethod(static_input=False), 0),
    "per-tensor static": (lambda: Fp8TensorLinearMethod(static_input=True), 1),
    "block 128x128": (lambda: Fp8BlockLinearMethod((128, 128)), 2),
}
ROWS = (1, 2, 8, 16, 17, 32, 64, 128, 144, 160, 192, 193, 256, 257, 1024)
# bfloat16 on an H100, the Qwen3-8B projections' output features (o_proj and down_proj 4096, qkv_proj
# 6144, gate_up_proj 24576): features -> {rows: (per-row dynamic, per-tensor static, block)}
H100_BF16 = {
    4096: {
        1: (GEMV, O16, GEMV),
        2: (O16, O16, O16),
        8: (O16, O16, O16),
        16: (O16, O16, O16),
        17: (O32, O32, O32),
        32: (O32, O32, O32),
        64: (O64, O64, O64),
        128: (O128, O128, O128),
        144: (T128_5, T128_5, T128_5),
        160: (T128_5, T128_5, T128_5),
        192: (T128_5, T128_5, T128_5),
        193: (T128_5, T128_5, T128_5),
        256: (T128_5, T128_5, T128_5),
        257: (SCALED_MM, SCALED_MM, GEMM),
        1024: (SCALED_MM, SCALED_MM, GEMM),
    },
    6144: {
        1: (GEMV, Q16, GEMV),
        2: (Q16, Q16, Q16),
        8: (Q16, Q16, Q16),
        16: (Q16, Q16, Q16),
        17: (Q32, Q32, Q32),
        32: (Q32, Q32, Q32),
        64: (Q64, Q64, Q64),
        128: (Q128, Q128, Q128),
        144: (Q144, Q144, B144),
        160: (Q160, Q160, B160),
        192: (Q192, Q192, T128x128),
        193: (T128x128, T128x128, T128x128),
        256: (T128x128, T128x128, T128x128),
        257: (SCALED_MM, SCALED_MM, GEMM),
        1024: (SCALED_MM, SCALED_MM, GEMM),
    },
    24576: {
        1: (GEMV, G16, GEMV),
        2: (G16, G16, GEMM),
        8: (G16, G16, GEMM),
        16: (G16, G16, GEMM),
        17: (G32, G32, G32),
        32: (G32, G32, G32),
        64: (G64, G64, G64),
        128: (G128, G128, G128),
        144: (G144, G144, B144),
        160: (G160, G160, B160),
        192: (G192, G192, T256),
        193: (SCALED_MM, SCALED_MM, T256),
        256: (SCALED_MM, SCALED_MM, T256),
        257: (SCALED_MM, SCALED_MM, GEMM),
        1024: (SCALED_MM, SCALED_MM, GEMM),
    },
}
# the same shapes in other conditions: (features, rows, dtype, device, input comes quantized) ->
# (per-row dynamic, per-tensor static, block)
OTHER_CONDITIONS = {
    # float16: no _scaled_mm (bfloat16 only), the GEMV and the transposed tiles as in bfloat16
    (4096, 1, torch.float16, H100, False): (GEMV, O16, GEMV),
    (4096, 256, torch.float16, H100, False): (T128_5, T128_5, T128_5),
    (4096, 257, torch.float16, H100, False): (GEMM, GEMM, GEMM),
    (24576, 256, torch.float16, H100, False): (GEMM, GEMM, T256),
    # float32: no GEMV, no _scaled_mm
    (4096, 1, torch.float32, H100, False): (O16, O16, O16),
    (4096, 1024, torch.float32, H100, False): (GEMM, GEMM, GEMM),
    # an A100 (108 SMs, no _scaled_mm): tiles for its grid (64 tiles split in round(108 / 64) = 2, 96 in 1)
    (4096, 1, torch.bfloat16, A100, False): (GEMV, O16, GEMV),
    (4096, 128, torch.bfloat16, A100, False): (O128, O128, O128),
    (6144, 128, torch.bfloat16, A100, False): (Q128, Q128, Q128),
    (6144, 256, torch.bfloat16, A100, False): (T128x128, T128x128, T128x128),
    (24576, 256, torch.bfloat16, A100, False): (GEMM, GEMM, T256),
    (4096, 1024, torch.bfloat16, A100, False): (GEMM, GEMM, GEMM),
    # a QuantizedActivation (from the RMSNorm or SiLU-and-mul before the layer) never takes the GEMV
    (4096, 1, torch.bfloat16, H100, True): (O16, O16, O16),
    (4096, 64, torch.bfloat16, H100, True): (O64, O64, O64),
    (24576, 256, torch.bfloat16, H100, True): (SCALED_MM, SCALED_MM, T256),
    (4096, 1024, torch.bfloat16, H100, True): (SCALED_MM, SCALED_MM, GEMM),
}


def fp8_layer(method, features: int, inputs: int = INPUTS, parts: list[int] | None = None) -> nn.Module:
    """A loaded layer of `features` x `inputs` under `method` (made of `parts`, by default one), its
    tensors on the CPU (zeros)."""
    layer = nn.Module()
    parts = parts or [features]
    layer.input_size, layer.output_sizes, layer.input_start = inputs, parts, 0
    layer.quant_method = method
    method.create_weights(layer, inputs, parts, torch.bfloat16)
    for param in layer.parameters():
        param.data.zero_()
    method.process_weights_after_loading(layer)
    return layer


@pytest.fixture(scope="module")
def layers() -> dict[tuple[str, int], nn.Module]:
    return {(layout, features): fp8_layer(make(), features) for layout, (make, _) in LAYOUTS.items()
            for features in H100_BF16}


def chosen_route(layer: nn.Module, rows: int, dtype: torch.dtype, quantized: bool = False) -> Fp8Route:
    """The route the layer's method chooses for an input of `rows` rows (on the faked device)."""
    x = torch.zeros(1, INPUTS, dtype=dtype).expand(rows, INPUTS)
    if quantized:
        x = QuantizedActivation(torch.zeros(rows, INPUTS, dtype=FP8_DTYPE), torch.ones(rows, 1), dtype)
    weight, scale, _, input_scale = layer.quant_method.operands(layer)
    return layer.quant_method.route_of(x, weight, scale, input_scale)


def on(monkeypatch, device: CudaDevice | None) -> None:
    monkeypatch.setattr(fp8_methods, "cuda_device", lambda t: device)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("features", list(H100_BF16))
def test_routes_on_an_h100_in_bfloat16(layers, monkeypatch, layout, features):
    on(monkeypatch, H100)
    column = LAYOUTS[layout][1]
    chosen = {rows: chosen_route(layers[layout, features], rows, torch.bfloat16) for rows in ROWS}
    assert chosen == {rows: routes[column] for rows, routes in H100_BF16[features].items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_routes_in_other_dtypes_devices_and_for_quantized_inputs(layers, monkeypatch, layout):
    column = LAYOUTS[layout][1]
    for (features, rows, dtype, device, quantized), routes in OTHER_CONDITIONS.items():
        on(monkeypatch, device)
        assert chosen_route(layers[layout, features], rows, dtype, quantized) == routes[column], \
            (features, rows, dtype, device, quantized)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_cpu_runs_the_twins(layers, monkeypatch, layout):
    on(monkeypatch, None)
    for rows in ROWS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert chosen_route(layers[layout, 4096], rows, dtype) == TWIN


@pytest.mark.parametrize("layout", ["per-channel", "per-tensor static", "block 128x128"])
@pytest.mark.parametrize("rows", [1, 8, 64, 193, 257])
def test_apply_runs_the_chosen_kernel_on_its_tile(layers, monkeypatch, layout, rows):
    """apply calls the kernel the route names, with its tile, on the quantized input (the 16-bit one
    for the GEMV); the kernels are stand-ins that record their calls (their math:
    tests/test_kernels_fp8_linear.py, tests/test_gemv.py)."""
    on(monkeypatch, H100)
    calls = []

    def stand_in(name, weight_arg):
        def kernel(*args, **kwargs):
            calls.append((name, args))
            if name == "quantize":
                return torch.zeros(args[0].shape, dtype=FP8_DTYPE), torch.ones(args[0].shape[0], 1)
            return torch.zeros(args[0].shape[0], args[weight_arg].shape[0], dtype=torch.bfloat16)
        return kernel

    for name, attribute, weight_arg in (("gemv", "fp8_gemv", 1), ("quantize", "quantize_activation", None),
                                        ("matmul", "fp8_matmul", 2), ("scaled_mm", "scaled_mm_per_channel", 2)):
        monkeypatch.setattr(fp8_methods, attribute, stand_in(name, weight_arg))
    layer = layers[layout, 24576]
    weight, scale, group_size, input_scale = layer.quant_method.operands(layer)
    x = torch.randn(rows, INPUTS, dtype=torch.bfloat16)
    route = chosen_route(layer, rows, torch.bfloat16)
    assert layer.quant_method.apply(layer, x).shape == (rows, 24576)
    if route == GEMV:
        assert [name for name, _ in calls] == ["gemv"] and torch.equal(calls[0][1][0], x)
        return
    (quantize, (x_in, group, static)), (gemm, args) = calls
    assert quantize == "quantize" and torch.equal(x_in, x) and group == group_size and static is input_scale
    assert args[2] is weight and args[3] is scale
    if route == SCALED_MM:
        assert gemm == "scaled_mm"
    else:
        assert gemm == "matmul" and args[7] == route.tile         # None: gemm_tile's tile


def test_whole_blocks_from_64_rows_take_cublaslt_on_hopper(monkeypatch):
    """Block scales of whole 128 x 128 blocks, rows of them 16 bytes or longer, go to torch's
    block-scaled GEMM from 64 rows in bfloat16 on Hopper, where torch has it; apply hands it the
    quantized input and the per-row scales (the kernel's math: tests/test_kernels_fp8_linear.py)."""
    on(monkeypatch, H100)
    monkeypatch.setattr(fp8_methods, "SCALED_MM_BLOCKS", True)
    blocks = Fp8Route("scaled_mm_blocks")
    whole = fp8_layer(Fp8BlockLinearMethod((128, 128)), 6144, inputs=512, parts=[4096, 1024, 1024])
    route = lambda layer, rows, dtype=torch.bfloat16: chosen_route_of(layer, rows, dtype)
    assert whole.fp8_whole_blocks
    assert [route(whole, rows) for rows in (64, 129, 256, 257, 4096)] == [blocks] * 5
    assert route(whole, 63).kernel == "transposed" and route(whole, 1) == GEMV
    assert route(whole, 256, torch.float16).kernel == "transposed"
    on(monkeypatch, A100)
    assert route(whole, 256).kernel == "transposed"
    on(monkeypatch, H100)
    for not_whole in (fp8_layer(Fp8BlockLinearMethod((128, 128)), 6144, inputs=256),        # 8 bytes a row
                      fp8_layer(Fp8BlockLinearMethod((128, 128)), 6144, 512, [6080, 64]),   # a part mid-block
                      fp8_layer(Fp8BlockLinearMethod((64, 64)), 6144, inputs=512)):
        assert not not_whole.fp8_whole_blocks and route(not_whole, 256).kernel == "transposed"
    monkeypatch.setattr(fp8_methods, "SCALED_MM_BLOCKS", False)   # a torch or CUDA without it
    assert route(whole, 256).kernel == "transposed"

    monkeypatch.setattr(fp8_methods, "SCALED_MM_BLOCKS", True)
    calls = []
    monkeypatch.setattr(fp8_methods, "quantize_activation",
                        lambda x, group, static: (torch.zeros(x.shape, dtype=FP8_DTYPE), torch.ones(x.shape[0], 4)))
    monkeypatch.setattr(fp8_methods, "scaled_mm_blocks",
                        lambda *args: calls.append(args) or torch.zeros(args[0].shape[0], 6144, dtype=torch.bfloat16))
    assert whole.quant_method.apply(whole, torch.randn(200, 512, dtype=torch.bfloat16)).shape == (200, 6144)
    (x_q, x_s, weight, scale, dtype, bias), = calls
    assert x_q.shape == (200, 512) and x_s.shape == (200, 4) and weight is whole.weight
    assert scale is whole.weight_scale_inv and dtype == torch.bfloat16 and bias is None


def chosen_route_of(layer: nn.Module, rows: int, dtype: torch.dtype) -> Fp8Route:
    """chosen_route for a layer whose method may know its scales are whole blocks (apply's route)."""
    x = torch.zeros(1, layer.input_size, dtype=dtype).expand(rows, layer.input_size)
    weight, scale, _, input_scale = layer.quant_method.operands(layer)
    return layer.quant_method.route_of(x, weight, scale, input_scale, layer.fp8_whole_blocks)


def test_129_to_256_rows_take_the_hopper_gemm_where_each_program_keeps_24_steps(monkeypatch):
    """Per-row scales of the Qwen3-8B projections at 129-192 rows in bfloat16 on Hopper: qkv, gate_up
    and down (K split in two: 48 steps each) take fp8_gemm_hopper, float16 rows too; o (split in two:
    16 steps) keeps its transposed tile, as do block scales, 128 rows and an A100; at 193-256 rows
    gate_up (tiles of several waves) keeps _scaled_mm; at 257 none take it; apply hands it the quantized
    input, the weight, its scales and the bias (the kernel's math: tests/test_fp8_gemm_hopper.py)."""
    route = lambda rows, k, n, per_group=False, dtype=torch.bfloat16, device=H100: \
        Fp8LinearMethod.route(rows, k, n, per_group, dtype, device, raw_input=False)
    qkv, o, gate_up, down = (4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)
    for rows in (129, 160, 192):
        assert [route(rows, *shape).kernel for shape in (qkv, o, gate_up, down)] == \
            ["hopper", "transposed", "hopper", "hopper"]
    for rows in (193, 256):
        assert [route(rows, *shape).kernel for shape in (qkv, o, gate_up, down)] == \
            ["hopper", "transposed", "scaled_mm", "hopper"]
    assert route(128, *qkv).kernel == "transposed" and route(257, *qkv).kernel == "scaled_mm"
    assert route(160, *qkv, per_group=True).kernel == "transposed"
    assert route(160, *qkv, dtype=torch.float16).kernel == "hopper"
    assert route(160, *qkv, device=A100).kernel == "transposed"

    on(monkeypatch, H100)
    calls = []
    monkeypatch.setattr(fp8_methods, "quantize_activation",
                        lambda x, group, static: (torch.zeros(x.shape, dtype=FP8_DTYPE), torch.ones(x.shape[0], 1)))
    monkeypatch.setattr(fp8_methods, "fp8_gemm_hopper",
                        lambda *args: calls.append(args) or torch.zeros(args[0].shape[0], args[2].shape[0]))
    layer = fp8_layer(Fp8ChannelLinearMethod(), 6144, inputs=4096)
    bias = torch.ones(6144, dtype=torch.bfloat16)
    assert layer.quant_method.apply(layer, torch.randn(160, 4096, dtype=torch.bfloat16), bias).shape == (160, 6144)
    (x_q, x_s, weight, scale, out_dtype, b), = calls
    assert x_q.dtype == FP8_DTYPE and x_q.shape == (160, 4096) and x_s.shape == (160, 1)
    assert weight is layer.weight and scale.shape == (6144, 1) and out_dtype == torch.bfloat16 and b is bias
