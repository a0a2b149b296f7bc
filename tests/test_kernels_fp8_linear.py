"""The float8 linear kernels against their torch twins (Triton's interpreter on the CPU in
float32/float16; bfloat16 on CUDA), and the twins against plain float math."""
import re

import pytest
import torch

from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX
from nanovllm.kernels.fp8_linear import (MULTI_WAVE_TILE, GemmTile, block_scaled_mm_available,
                                         block_scaled_mm_operands, decode_tile, dequantize_ref, fp8_matmul,
                                         fp8_matmul_ref, quantize_activation, quantize_activation_ref,
                                         scaled_mm_blocks, two_piece_block_tile, two_piece_tile)
from nanovllm.quantization.fp8 import Fp8LinearMethod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]


def weight(n: int, k: int, group: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=generator)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=generator) * 0.01 + 0.001
    q = (w * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.to(DEVICE), scale.to(DEVICE)


def test_activation_twin_is_max_abs_over_448_per_token_group():
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [30.0], [0.0]])
    q, s = quantize_activation_ref(x, 128)
    assert s.shape == (3, 2)
    assert torch.allclose(s[1, 0], x[1, :128].abs().max() / FP8_MAX)
    assert torch.allclose(s[1, 1], x[1, 128:].abs().max() / FP8_MAX)
    assert (s[2] > 0).all() and (q[2].float() == 0).all()          # a zero token stays zero, no NaN
    assert q.float().abs().amax(dim=1)[:2].eq(FP8_MAX).all()      # each token's largest maps to 448
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of |x| among normals (|x / scale| >= 2^-6), and
    # 2^-10 of the scale among subnormals, where the step is 2^-9
    bound = torch.maximum(x.abs() * 2 ** -4, s.repeat_interleave(128, dim=1)[:, :200] * 2 ** -10)
    assert ((dequantize_ref(q, s, 128) - x).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, group", [(1, 64, 64), (5, 200, 128), (33, 256, 128), (4, 96, 96)])
def test_activation_kernel_matches_twin(dtype, m, k, group):
    x = (torch.randn(m, k) * 3).to(dtype).to(DEVICE)
    q, s = quantize_activation(x, group)
    q_ref, s_ref = quantize_activation_ref(x, group)
    torch.testing.assert_close(s, s_ref)
    # the same float32 division, rounded to e4m3 the same way: the same bits
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_kernel_rounds_subnormal_ties_to_even(dtype):
    # absmax 448 makes the scale 1: x / scale lands exactly on halfway points between e4m3
    # subnormals (steps of 2^-9), where rounding up and rounding to even differ
    ties = torch.tensor([1, 3, 5, 7, -3, -5, 9, 15], dtype=torch.float32) * 2 ** -10
    x = torch.cat([torch.tensor([448.0]), ties, -ties[:7]]).reshape(1, 16).to(dtype).to(DEVICE)
    q, s = quantize_activation(x, 16)
    q_ref, s_ref = quantize_activation_ref(x, 16)
    assert s.item() == 1.0 and s_ref.item() == 1.0
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # torch's cast rounds these ties to even: 2^-10 -> 0, 3 * 2^-10 and 5 * 2^-10 -> 2 * 2^-9
    assert q_ref.float()[0, 1:4].mul(512).tolist() == [0.0, 2.0, 2.0]


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


def gemm_case(dtype, m, n, k, group, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(dtype).to(DEVICE)
    w_q, w_s = weight(n, k, group, g)
    b = (torch.randn(n, generator=g)).to(dtype).to(DEVICE) if bias else None
    return x, w_q, w_s, b


def assert_close_to_twin(y, y_ref):
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[y_ref.dtype]
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol * y_ref.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, group, bias, tile", [
    (5, 96, 256, 256, False, GemmTile(16, 32, 64, 4, 2, 1, True)),    # per-channel, partial tiles
    (37, 100, 384, 128, True, GemmTile(16, 32, 64, 4, 2, 2, True)),   # block scales, K split in two: bias added once
    (20, 64, 512, 512, True, GemmTile(32, 64, 128, 4, 2, 3, True)),   # per-channel, three K splits (the last short)
    (9, 48, 320, 128, False, GemmTile(16, 16, 256, 4, 2, 1, True)),   # K step larger than the group: steps by groups
    (21, 80, 384, 128, True, GemmTile(16, 32, 128, 4, 2, 2, False)),  # not swapped, K split: the same kernel
    (50, 96, 256, 256, True, GemmTile(32, 32, 64, 4, 2, 1, True, 16)),  # a second piece of 16 tokens: two tiles,
                                                                        # the second's extra piece past M
    (45, 80, 384, 128, True, GemmTile(32, 32, 64, 4, 2, 2, True, 16)),  # block scales, two pieces, K split in two
])
def test_tiles_match_twin(dtype, m, n, k, group, bias, tile):
    x, w_q, w_s, b = gemm_case(dtype, m, n, k, group, bias, m + n + k)
    x_q, x_s = quantize_activation_ref(x, group)
    y = fp8_matmul(x_q, x_s, w_q, w_s, group, dtype, b, tile)
    assert_close_to_twin(y, fp8_matmul_ref(x_q, x_s, w_q, w_s, group, dtype, b))


def test_split_k_leaves_its_workspace_zero():
    """The last K split of each tile adds the splits' sums, writes the output and sets the tile's
    arrival count back to zero, so the next call (another shape, then the first again) starts from
    zeros; the shared float32 workspace stays untouched."""
    from nanovllm.kernels.zeroed_workspace import zeroed_workspace
    dtype = DTYPES[0]
    small, large = gemm_case(dtype, 5, 96, 384, 128, True, 1), gemm_case(dtype, 37, 160, 512, 512, False, 2)
    workspace_is_zero = lambda: not any(zeroed_workspace(small[0].device, kind, 0).any()
                                        for kind in (torch.float32, torch.int32))

    def both(x, w_q, w_s, b, group, tile):
        x_q, x_s = quantize_activation_ref(x, group)
        return (fp8_matmul(x_q, x_s, w_q, w_s, group, dtype, b, tile),
                fp8_matmul_ref(x_q, x_s, w_q, w_s, group, dtype, b))
    first, ref = both(*small, 128, GemmTile(16, 32, 128, 4, 2, 3, True))
    assert_close_to_twin(first, ref)
    assert workspace_is_zero()
    assert_close_to_twin(*both(*large, 512, GemmTile(16, 64, 128, 4, 2, 4, True)))
    assert workspace_is_zero()
    assert torch.equal(both(*small, 128, GemmTile(16, 32, 128, 4, 2, 3, True))[0], first)


@pytest.mark.parametrize("m, n, group", [
    (40, 512, 128),     # one wave of 64-feature programs over 64 tokens
    (128, 256, 128),    # a grid of half a wave at 128 tokens: 64 tokens a program
    (100, 1024, 128),   # 128 features a program keep it to one wave
    (128, 2048, 256),   # several waves: three stages
    (200, 2048, 128),   # several waves past 128 tokens: 256 tokens a program (block scales)
])
def test_every_decode_tile_matches_twin(m, n, group):
    """Each branch of decode_tile (an 8-SM grid makes the small shapes take them) runs the twin's math."""
    dtype = DTYPES[0]
    tile = decode_tile(m, n, 8)
    x, w_q, w_s, _ = gemm_case(dtype, m, n, 256, group, False, m * n)
    x_q, x_s = quantize_activation_ref(x, group)
    assert_close_to_twin(fp8_matmul(x_q, x_s, w_q, w_s, group, dtype, None, tile),
                         fp8_matmul_ref(x_q, x_s, w_q, w_s, group, dtype))


def test_decode_tile_on_an_h100():
    """The tiles of the 8B projections' sweeps on 132 SMs (which batches take them is the FP8 method's
    route: tests/test_quantization_fp8_routes.py)."""
    assert decode_tile(8, 4096, 132) == GemmTile(16, 64, 128, 4, 7, 2, True)      # 64 tiles: K split in two
    assert decode_tile(100, 4096, 132) == GemmTile(128, 64, 128, 4, 7, 2, True)
    assert decode_tile(64, 6144, 132) == GemmTile(64, 64, 128, 4, 7, 1, True)     # 96 tiles: no split
    assert decode_tile(32, 24576, 132) == GemmTile(32, 64, 128, 4, 5, 1, True)    # several waves
    assert decode_tile(128, 24576, 132) == GemmTile(128, 64, 128, 4, 3, 1, True)
    assert decode_tile(256, 4096, 132) == GemmTile(128, 64, 128, 4, 5, 1, True)   # one wave past 128 tokens
    assert decode_tile(256, 6144, 132) == GemmTile(128, 128, 128, 8, 5, 1, True)  # 128 features: one wave
    assert decode_tile(256, 24576, 132) == MULTI_WAVE_TILE == GemmTile(256, 64, 128, 8, 5, 1, True)


@pytest.mark.parametrize("m, n, k, extra", [
    (144, 1024, 256, 16),   # several waves on 8 SMs, a second piece of 16 tokens: 128 features a program
    (176, 1024, 256, 64),   # several waves, a second piece of 64 tokens: 64 features
    (160, 384, 256, 32),    # one wave
    (136, 256, 8192, 16),   # half a wave of long rows: K split in two; pieces of 16 tokens or more
])
def test_every_two_piece_tile_matches_twin(m, n, k, extra):
    tile = two_piece_tile(m, n, k, 8)
    assert tile.extra_m == extra
    dtype = DTYPES[0]
    x, w_q, w_s, _ = gemm_case(dtype, m, n, k, k, False, m + n)
    x_q, x_s = quantize_activation_ref(x, k)
    assert_close_to_twin(fp8_matmul(x_q, x_s, w_q, w_s, k, dtype, None, tile),
                         fp8_matmul_ref(x_q, x_s, w_q, w_s, k, dtype))


@pytest.mark.parametrize("m, n, k, split, extra", [
    (144, 384, 256, 2, 16),   # several programs a pair of SMs, a second piece of 16 tokens: K split in two
    (160, 384, 256, 1, 32),   # a second piece of 32 tokens: unsplit
    (136, 64, 8192, 3, 16),   # long rows: K split in three
])
def test_every_two_piece_block_tile_matches_twin(m, n, k, split, extra):
    """Block scales (a group of 128 columns) over two token pieces, each piece's K splits summed apart."""
    tile = two_piece_block_tile(m, n, k, 8)
    assert (tile.split_k, tile.extra_m, tile.block_n, tile.num_stages) == (split, extra, 64, 3)
    dtype = DTYPES[0]
    x, w_q, w_s, b = gemm_case(dtype, m, n, k, 128, True, m + k)
    x_q, x_s = quantize_activation_ref(x, 128)
    assert_close_to_twin(fp8_matmul(x_q, x_s, w_q, w_s, 128, dtype, b, tile),
                         fp8_matmul_ref(x_q, x_s, w_q, w_s, 128, dtype, b))


def test_two_piece_block_tiles_of_the_8b_projections_on_an_h100():
    """The 8B projections' best block-scale tiles of the 129-192-token sweep on 132 SMs (docs/benchmarks.md)."""
    assert two_piece_block_tile(144, 24576, 4096, 132) == GemmTile(128, 64, 128, 4, 3, 2, True, 16)   # gate_up
    assert two_piece_block_tile(160, 6144, 4096, 132) == GemmTile(128, 64, 128, 4, 3, 1, True, 32)    # qkv
    assert two_piece_block_tile(144, 4096, 12288, 132) == GemmTile(128, 64, 128, 4, 3, 3, True, 16)   # down
    assert two_piece_block_tile(144, 4096, 4096, 132) is None                                         # o
    assert two_piece_block_tile(161, 24576, 4096, 132) is None and two_piece_block_tile(128, 6144, 4096, 132) is None


def test_two_piece_tiles_of_the_8b_projections_on_an_h100():
    """The 8B projections' best tiles of the 129-192-token sweep on 132 SMs (docs/benchmarks.md)."""
    assert two_piece_tile(144, 24576, 4096, 132) == GemmTile(128, 128, 128, 8, 3, 1, True, 16)   # gate_up
    assert two_piece_tile(192, 24576, 4096, 132) == GemmTile(128, 64, 128, 4, 5, 1, True, 64)
    assert two_piece_tile(160, 6144, 4096, 132) == GemmTile(128, 64, 128, 4, 5, 1, True, 32)     # qkv
    assert two_piece_tile(160, 4096, 12288, 132) == GemmTile(128, 64, 128, 4, 5, 2, True, 32)    # down
    assert two_piece_tile(160, 4096, 4096, 132) is None                                         # o
    assert two_piece_tile(128, 24576, 4096, 132) is None and two_piece_tile(193, 24576, 4096, 132) is None


def decode_tiles_ptxas_log() -> str:
    """Every tile decode_tile, two_piece_tile and two_piece_block_tile (block scales) give the 8B
    projections on 132 SMs, built for sm_90a as fp8_matmul launches it for bfloat16 output (no GPU
    needed; outside the interpreter, so the test runs this in a child): ptxas's report and the shared
    memory each launch asks for."""
    from nanovllm.kernels.fp8_linear import _fp8_gemm_kernel
    from tests.test_int4_gemm import ptxas_report, sm90a_build
    pointers = dict(a_ptr="*fp8e4nv", a_s_ptr="*fp32", w_ptr="*fp8e4nv", w_s_ptr="*fp32", bias_ptr="*fp32",
                    out_ptr="*bf16", partial_ptr="*fp32", arrivals_ptr="*i32")
    aligned = ["a_ptr", "w_ptr", "out_ptr", "partial_ptr", "N", "K", "K_PER_SPLIT"]
    log = ""
    tiles = {decode_tile(rows, n, 132) for n in (4096, 6144, 24576) for rows in (1, 17, 33, 65, 129, 256)}
    tiles = {(tile, False) for tile in tiles}
    tiles |= {(two_piece_tile(rows, n, k, 132), False) for n, k in ((24576, 4096), (6144, 4096), (4096, 12288))
              for rows in (144, 176)}
    tiles |= {(two_piece_block_tile(rows, n, k, 132), True) for n, k in ((24576, 4096), (4096, 12288))
              for rows in (144, 160)}
    for tile, per_group in sorted(tiles):
        constants = dict(HAS_BIAS=False, PER_GROUP=per_group, SPLIT=tile.split_k > 1, SWAPPED=True,
                         BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EXTRA_M=tile.extra_m,
                         PDL=True)
        build = sm90a_build(_fp8_gemm_kernel, pointers, constants, aligned, num_warps=tile.num_warps,
                            num_stages=tile.num_stages)
        log += ptxas_report(build.asm["ptx"]) + f"{tuple(tile)} {per_group=} shared memory: " \
            f"{build.metadata.shared} bytes\n"
    return log


def test_decode_tiles_build_for_hopper():
    """Seven stages of 128 tokens (and five of 256) must fit a Hopper program's 227 KiB of shared
    memory, without spills or serialized products. One exception: block scales over a second piece
    of 32 tokens, K unsplit, hold two sets of sums each and spill 8 bytes at 255 registers; on an
    H200 that tile still beat decode_tile's (gate_up 97.9 against 112.6 us at 160 tokens)."""
    from tests.test_int4_gemm import compiled_in_child
    log = compiled_in_child("from tests.test_kernels_fp8_linear import decode_tiles_ptxas_log\n"
                            "print(decode_tiles_ptxas_log())")
    builds = re.findall(r"(\d+) bytes spill stores.*?\n(\(.*?\)) per_group=(\w+)", log, re.DOTALL)
    assert len(builds) >= 10 and len(builds) == log.count("Compiling entry function '_fp8_gemm_kernel' for 'sm_90a'")
    spills = {(tile, per_group): int(spilled) for spilled, tile, per_group in builds if spilled != "0"}
    assert all(key == ("(128, 64, 128, 4, 3, 1, True, 32)", "True") and spilled <= 8
               for key, spilled in spills.items()), log
    assert "C751" not in log and "serialized" not in log, log
    assert max(int(size) for size in re.findall(r"shared memory: (\d+) bytes", log)) <= 227 * 1024, log


@pytest.mark.skipif(DEVICE != "cuda", reason="the FP8 method's CUDA routes (the CPU runs the twins)")
@pytest.mark.parametrize("m", [2, 16, 48, 64, 100, 128, 144, 160, 176, 192, 256, 300])
@pytest.mark.parametrize("n, group", [(6144, 1024), (4096, 1024), (24576, 1024), (6144, 128)])
def test_fp8_routes_on_cuda_match_twin_at_decode_sizes(m, n, group):
    x, w_q, w_s, b = gemm_case(torch.bfloat16, m, n, 1024, group, True, m + n)
    x_q, x_s = quantize_activation_ref(x, group)
    y = Fp8LinearMethod().multiply(x, w_q, w_s, group, bias=b)
    assert_close_to_twin(y, fp8_matmul_ref(x_q, x_s, w_q, w_s, group, torch.bfloat16, b))


def whole_block_case(m: int, n: int, k: int, seed: int):
    """x quantized per token and 128 columns, and a weight whose scales repeat per 128 x 128 block."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).to(DEVICE)
    w_q, _ = weight(n, k, 128, g)
    blocks = torch.rand(n // 128, k // 128, generator=g) * 0.01 + 0.001
    x_q, x_s = quantize_activation_ref(x, 128)
    return x_q, x_s, w_q, blocks.repeat_interleave(128, 0).to(DEVICE)


@pytest.mark.parametrize("m", [5, 16, 37])
def test_block_scaled_mm_operands_hold_the_block_product(m):
    """cuBLASLt's operands for block scales (the layouts torch's scaled_mm checks: activation scales
    column-major, one weight scale a block, rows padded to a multiple of 16 with zeros), multiplied
    as it reads them (each 1 x 128 and 128 x 128 scale over its block), give the block layout's product."""
    x_q, x_s, w_q, w_s = whole_block_case(m, 256, 512, m)
    a, a_s, w_blocks = block_scaled_mm_operands(x_q, x_s, w_s)
    rows = -(-m // 16) * 16
    assert a.shape == (rows, 512) and a.dtype == FP8_DTYPE and not a[m:].view(torch.uint8).any()
    assert a_s.shape == (rows, 4) and a_s.stride() == (1, rows)
    assert w_blocks.shape == (4, 2) and w_blocks.t().is_contiguous()
    product = (a.float() * a_s.repeat_interleave(128, 1)) @ \
        (w_q.float() * w_blocks.t().repeat_interleave(128, 0).repeat_interleave(128, 1)).T
    assert_close_to_twin(product[:m], fp8_matmul_ref(x_q, x_s, w_q, w_s, 128, torch.float32))


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] != 9 or not block_scaled_mm_available(),
                    reason="torch's block-scaled GEMM runs on Hopper, from CUDA 12.9")
@pytest.mark.parametrize("m", [64, 129, 144, 200, 1037])
def test_scaled_mm_blocks_matches_twin_on_hopper(m):
    x_q, x_s, w_q, w_s = whole_block_case(m, 768, 1024, m)
    b = torch.randn(768, device=DEVICE).to(torch.bfloat16)
    assert_close_to_twin(scaled_mm_blocks(x_q, x_s, w_q, w_s, torch.bfloat16, b),
                         fp8_matmul_ref(x_q, x_s, w_q, w_s, 128, torch.bfloat16, b))
