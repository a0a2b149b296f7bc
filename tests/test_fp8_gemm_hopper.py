"""The Gluon float8 GEMM for Hopper against fp8_linear's torch twin (on a Hopper GPU: Gluon has no
interpreter): partial tiles of features and tokens, two-piece tiles, the bias added once with K
split, the last wave split on a few SMs, the workspace left zero; built for sm_90a without a GPU,
no spills, no serialized products, within a Hopper program's shared memory."""
import re

import pytest
import torch

from nanovllm.kernels import fp8_gemm_hopper as hopper
from nanovllm.kernels.fp8_linear import fp8_matmul_ref, quantize_activation_ref
from tests.test_int4_gemm import compiled_in_child, ptxas_report
from tests.test_kernels_fp8_linear import DEVICE, assert_close_to_twin, gemm_case

ON_HOPPER = DEVICE == "cuda" and hopper.HAS_GLUON and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernels run compiled, on a Hopper GPU")
TILES = [hopper.HopperFp8Tile(16), hopper.HopperFp8Tile(128), hopper.HopperFp8Tile(128, 16),
         hopper.HopperFp8Tile(128, 64), hopper.HopperFp8Tile(256), hopper.HopperFp8Tile(64, 32),
         hopper.HopperFp8Tile(128, block_n=128)]


def both(m: int, n: int, k: int, bias: bool, seed: int, **launch):
    x, w_q, w_s, b = gemm_case(torch.bfloat16, m, n, k, k, bias, seed)
    x_q, x_s = quantize_activation_ref(x, k)
    return (hopper.fp8_gemm_hopper(x_q, x_s, w_q, w_s, torch.bfloat16, b, **launch),
            fp8_matmul_ref(x_q, x_s, w_q, w_s, k, torch.bfloat16, b))


@needs_hopper
@pytest.mark.parametrize("m, n, k, bias, tile, split_k", [
    (70, 200, 512, True, None, 1),                  # a partial feature tile, 70 of 128 tokens
    (150, 200, 640, False, None, 3),                # 128 + 32 tokens, K split in 3 (5 steps: 2, 2, 1)
    (190, 96, 512, True, None, 2),                  # 128 + 64 tokens, bias added once with K split
    (300, 200, 512, True, None, None),              # partial 128 x 128 tiles (two warp groups)
    (230, 136, 640, True, None, 3),                 # the same, K split in 3
    (300, 200, 512, True, TILES[4], None),          # partial tiles of 256 tokens
    (9, 136, 384, False, TILES[0], 2),
    (100, 130, 512, True, TILES[5], 4),             # 64 + 32 tokens, K split in 4
    (144, 200, 256, False, TILES[2], None),         # 128 + 16
])
def test_matches_twin(m, n, k, bias, tile, split_k):
    out, ref = both(m, n, k, bias, m + n, tile=tile, split_k=split_k)
    assert_close_to_twin(out, ref)


@needs_hopper
@pytest.mark.parametrize("m, sms, tile, grid", [(70, 4, (128, 0, 64), (9, 8, 4)), (150, 4, (128, 32, 64), (9, 8, 4)),
                                               (250, 3, (128, 0, 128), (10, 9, 3))])
def test_last_wave_split_matches_twin(monkeypatch, m, sms, tile, grid):
    """520 features, the last tile partial (9 tiles of 64 features; 10 of 128 x 128 at 250 tokens):
    on 4 SMs 8 run whole and the ninth in 4 K ranges, on 3 SMs 9 and the tenth in 3; twice, the second
    finding the workspace the first left zero."""
    from nanovllm.kernels.zeroed_workspace import zeroed_workspace
    monkeypatch.setattr(hopper, "sm_count", lambda device: sms)
    assert hopper.hopper_tile(m) == tile and hopper.schedule(m, 520, 512, sms) == grid
    for seed in range(2):
        assert_close_to_twin(*both(m, 520, 512, True, seed))
    assert not any(zeroed_workspace(torch.device("cuda"), kind, 0).any() for kind in (torch.float32, torch.int32))


def test_hopper_tile_and_stages():
    """64 features by tokens as wide as they need: a power of two up to 128, 128 + a power of two up
    to 192; 128 x 128 beyond (two warp groups); the ring as deep as 192 KiB of buffers hold (at most 6)."""
    assert [tuple(hopper.hopper_tile(m)) for m in (2, 65, 128, 129, 150, 161, 192, 193, 256)] == \
        [(16, 0, 64), (128, 0, 64), (128, 0, 64), (128, 16, 64), (128, 32, 64), (128, 64, 64), (128, 64, 64),
         (128, 0, 128), (128, 0, 128)]
    assert [tile.stages for tile in TILES] == [6, 6, 6, 6, 4, 6, 6]
    assert [tile.num_warps for tile in TILES] == [4] * 6 + [8]


def test_pays_where_each_program_keeps_24_steps_of_k():
    """The 8B projections on 132 SMs at 129-192 tokens: qkv's 96 tiles and gate_up's 384 run whole
    (32 steps), down's 64 split in halves (48 steps each), o's 64 in halves of 16 steps: not o. At
    193-256 in 128 x 128 tiles: qkv's 96 and down's 64 (in halves) fit one wave, gate_up's 384 do not."""
    qkv, o, gate_up, down = (4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)
    for m in (129, 160, 192):
        assert [hopper.pays(m, n, k, 132) for k, n in (qkv, o, gate_up, down)] == [True, False, True, True]
    for m in (193, 256):
        assert [hopper.pays(m, n, k, 132) for k, n in (qkv, o, gate_up, down)] == [True, False, False, True]
    assert hopper.schedule(160, 4096, 12288, 132) == (64, 0, 2)
    assert hopper.schedule(256, 4096, 12288, 132) == (64, 0, 2) and hopper.schedule(256, 6144, 4096, 132) == (96, 0, 1)
    assert hopper.schedule(160, 24576, 4096, 132) == (384, 384, 1)


def build(tile: hopper.HopperFp8Tile, split: bool):
    """The kernel built for sm_90a as fp8_gemm_hopper launches it for bfloat16 output (compiled for a
    target without a GPU; outside the interpreter, so the test runs this in a child)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental import gluon
    kernel = hopper._fp8_gemm_hopper_kernel
    index = {name: i for i, name in enumerate(kernel.arg_names)}
    warps = tile.num_warps
    constants = dict(HAS_BIAS=True, BLOCK_N=tile.block_n, BLOCK_M=tile.block_m, EXTRA_M=tile.extra_m,
                     STAGES=tile.stages, SPLIT=split, num_warps=warps)
    descriptor = lambda rows: f"tensordesc<fp8e4nv[{rows}, {hopper.BLOCK_K}],{hopper.operand_layout(rows)!r}>"
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(x_desc=descriptor(tile.block_m), x2_desc=descriptor(tile.extra_m or tile.block_m),
                     w_desc=descriptor(tile.block_n), x_scale_ptr="*fp32", w_scale_ptr="*fp32", bias_ptr="*bf16",
                     out_ptr="*bf16",
                     # without a split, the launch passes the output for both (split_workspace)
                     partial_ptr="*fp32" if split else "*bf16", arrivals_ptr="*i32" if split else "*bf16",
                     **{name: "constexpr" for name in constants})
    aligned = ["x_scale_ptr", "w_scale_ptr", "bias_ptr", "out_ptr", "partial_ptr", "arrivals_ptr", "N", "K",
               "K_PER_SPLIT"]
    source = gluon._runtime.GluonASTSource(kernel, signature, {(index[name],): v for name, v in constants.items()},
                                           attrs={(index[name],): [["tt.divisibility", 16]] for name in aligned})
    return triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def ptxas_log() -> str:
    """ptxas's report on every tile of TILES, split and not, and the shared memory each launch asks for."""
    log = ""
    for tile in TILES:
        for split in (False, True):
            compiled = build(tile, split)
            log += ptxas_report(compiled.asm["ptx"]) + f"shared memory: {compiled.metadata.shared} bytes\n"
    return log


@pytest.mark.skipif(not hopper.HAS_GLUON, reason="needs Triton's Gluon")
def test_builds_for_hopper():
    log = compiled_in_child("from tests.test_fp8_gemm_hopper import ptxas_log\nprint(ptxas_log())")
    assert log.count("Compiling entry function '_fp8_gemm_hopper_kernel' for 'sm_90a'") == 2 * len(TILES), log
    assert "C751" not in log and "serialized" not in log, log
    assert log.count("0 bytes spill stores") == 2 * len(TILES), log
    # an H100 or H200 gives a program at most 227 KiB of shared memory
    assert max(int(size) for size in re.findall(r"shared memory: (\d+) bytes", log)) <= 227 * 1024, log


def test_scales_of_another_layout_are_refused():
    """Block scales (one a group of K) are fp8_matmul's: this kernel says so rather than misread them."""
    x_q, w_q = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x_s"):
        hopper.fp8_gemm_hopper(x_q, torch.ones(4, 2), w_q, torch.ones(64, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="w_s"):
        hopper.fp8_gemm_hopper(x_q, torch.ones(4, 1), w_q, torch.ones(64, 2), torch.bfloat16)
