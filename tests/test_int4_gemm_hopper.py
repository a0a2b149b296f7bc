"""int4_gemm's Gluon kernel for Hopper against int_gemm's torch twin (on a Hopper GPU: Gluon has no
interpreter): partial row and column tiles, K split or not, groups of several steps, the workspace
left zero; built for sm_90a without a GPU, ptxas keeps its products in flight, spills nothing and
stays within a Hopper program's shared memory; the weight-only layer sends two rows and more to it on
Hopper."""

import re

import pytest
import torch

from nanovllm.kernels import int4_gemm_hopper as hopper
from nanovllm.kernels.hopper_split_tiles import balanced_split
from nanovllm.kernels.int4_gemm import dequantize_asm
from nanovllm.kernels.int_gemm import int_gemm_ref
from tests.test_int4_gemm import compiled_in_child, ptxas_report
from tests.test_int4_gemv import (DEVICE, assert_layer_routes, assert_splits_leave_the_workspace_zero, awq_layer,
                                  tolerance)

ON_HOPPER = DEVICE == "cuda" and hopper.HAS_GLUON and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernels run compiled, on a Hopper GPU")


def both(x, layer, group_size, config=None, split_k=None):
    args = (layer["qweight"], layer["scales"], layer["scaled_zeros"])
    return hopper.int4_gemm_hopper(x, *args, group_size, split_k=split_k), int_gemm_ref(x, *args, 4, group_size)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,split_k", [(1, None), (5, 3), (8, 1), (11, None), (16, 2), (20, None), (32, 3),
                                          (40, 1), (64, None), (65, None), (96, 2), (112, None), (130, 1),
                                          (150, 3), (161, None), (192, 1), (300, 2)])
def test_matches_twin(dtype, rows, split_k):
    """200 columns: a partial column tile; 1-64 rows: x tiles of 8 to 64 rows, some partly filled;
    65-128 rows: tiles of 128; 129-160: tiles of two pieces (128 + 32); 161 and more: partial row tiles
    of 256; K = 512 split in 3: uneven runs of steps."""
    k, n, group_size = 512, 200, 128
    layer = awq_layer(k, n, group_size, dtype, seed=2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    out, ref = both(x, layer, group_size, split_k=split_k)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@needs_hopper
@pytest.mark.parametrize("group_size", [256, 512])      # two steps per group; one group (per channel)
def test_groups_of_several_steps(group_size):
    layer = awq_layer(512, 96, group_size, torch.bfloat16, seed=3)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    out, ref = both(x, layer, group_size)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


@needs_hopper
@pytest.mark.parametrize("rows,k,tile,schedule", [(70, 512, (128, 0), (4, 4)), (150, 512, (128, 32), (4, 4)),
                                                  (200, 512, (128, 0), (8, 2)), (300, 3072, (256, 0), (8, 2))])
def test_last_wave_split_matches_twin(monkeypatch, rows, k, tile, schedule):
    """On 4 SMs, 520 columns (5 column tiles, the last partial): 70 and 150 rows run 4 tiles whole
    and the fifth in 4 K ranges; 200 rows (two 128-row tiles) and 300 (two of 256: 24 steps of K) 8
    whole and 2 in halves."""
    monkeypatch.setattr(hopper, "sm_count", lambda device: 4)
    n, group_size = 520, 128
    tiles = -(-rows // sum(tile)) * -(-n // hopper.BLOCK_N)
    assert hopper.rows_tile(rows, n, k, 4) == tile and hopper.schedule(rows, k, tiles, 4) == schedule
    layer = awq_layer(k, n, group_size, torch.bfloat16, seed=5)
    for seed in range(2):      # the second call finds the workspace the first left zero
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16)
        out, ref = both(x, layer, group_size)
        torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


def test_balanced_split_fills_the_last_wave():
    """The 8B projections on 132 SMs: gate_up's 192 tiles run 132 whole and 60 in halves; qkv's 48
    and o's / down's 32 split to about one program an SM; 384 tiles leave the last wave as it is."""
    assert balanced_split(192, 32, 132) == (132, 2)
    assert balanced_split(48, 32, 132) == (0, 2)
    assert balanced_split(32, 96, 132) == (0, 4)
    assert balanced_split(384, 32, 132) == (384, 1)
    assert balanced_split(264, 32, 132) == (264, 1)
    assert balanced_split(133, 2, 132) == (132, 2)      # no more splits than steps
    assert balanced_split(200, 32, 132) == (200, 1)     # a last wave over half full


def test_rows_tile():
    """The 8B projections on 132 SMs: 8 to 64 rows as wide as they need, 128 + 32 at 129-160; past
    160, 256 rows where a program keeps 24 steps of K (gate_up, down), else 128 (qkv split in 2, o in 4)."""
    qkv, o, gate_up, down = (4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)
    assert [hopper.rows_tile(m, 6144, 4096, 132) for m in (2, 9, 33, 64, 65, 128, 129, 160)] == \
        [(8, 0), (16, 0), (64, 0), (64, 0), (128, 0), (128, 0), (128, 32), (128, 32)]
    assert [hopper.rows_tile(m, n, k, 132) for m in (161, 256) for k, n in (qkv, o, gate_up, down)] == \
        [(128, 0), (128, 0), (256, 0), (256, 0)] * 2


@needs_hopper
def test_splits_leave_the_workspace_zero():
    assert_splits_leave_the_workspace_zero(both, (3, 150), None)


@needs_hopper
@pytest.mark.parametrize("rows,expect_hopper", [(1, False), (2, True), (17, True), (64, True), (65, True), (300, True)])
def test_weight_only_layer_routes_to_it_on_hopper(monkeypatch, rows, expect_hopper):
    assert_layer_routes(monkeypatch, "int4_gemm_hopper", rows, expect_hopper)


def test_takes_16_bit_rows_on_hopper_only():
    assert not hopper.takes(torch.zeros(128, 256, dtype=torch.bfloat16))       # on the CPU
    if ON_HOPPER:
        assert hopper.takes(torch.zeros(2, 256, dtype=torch.bfloat16, device="cuda"))
        assert not hopper.takes(torch.zeros(1, 256, dtype=torch.bfloat16, device="cuda"))
        assert not hopper.takes(torch.zeros(128, 256, dtype=torch.float32, device="cuda"))


def hopper_build(split: bool, block_m: int = hopper.BLOCK_M, extra_m: int = 0):
    """The kernel built for sm_90a as int4_gemm_hopper launches it for bfloat16 (compiled for a target
    without a GPU; outside the interpreter, so the test runs this in a child)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental import gluon
    kernel = hopper._int4_gemm_hopper_kernel
    index = {name: i for i, name in enumerate(kernel.arg_names)}
    stages = hopper.WIDE_STAGES if block_m == hopper.WIDE_ROWS else hopper.STAGES
    constants = dict(GROUP_SIZE=128, BLOCK_N=hopper.BLOCK_N, BLOCK_M=block_m, EXTRA_M=extra_m, STAGES=stages,
                     SPLIT=split, ASM_LOW=dequantize_asm(torch.bfloat16, 0), ASM_HIGH=dequantize_asm(torch.bfloat16, 4),
                     num_warps=hopper.NUM_WARPS)
    x_desc, x2_desc = (f"tensordesc<bf16[{rows}, 64],{hopper.x_shared_layout(torch.bfloat16, rows)!r}>"
                       for rows in (block_m, extra_m or block_m))
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(x_desc=x_desc, x2_desc=x2_desc,
                     w_desc=f"tensordesc<i32[16, {hopper.BLOCK_N}],{hopper.words_shared_layout()!r}>",
                     scales_ptr="*bf16", zeros_ptr="*bf16", out_ptr="*bf16",
                     # without a split, the launch passes the output for both (split_workspace)
                     partial_ptr="*fp32" if split else "*bf16", arrivals_ptr="*i32" if split else "*bf16",
                     **{name: "constexpr" for name in constants})
    aligned = ["scales_ptr", "zeros_ptr", "out_ptr", "partial_ptr", "arrivals_ptr", "N", "K", "K_PER_SPLIT"]
    source = gluon._runtime.GluonASTSource(kernel, signature, {(index[name],): v for name, v in constants.items()},
                                           attrs={(index[name],): [["tt.divisibility", 16]] for name in aligned})
    return triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": hopper.NUM_WARPS})


def hopper_ptxas_log(split: bool, block_m: int = hopper.BLOCK_M, extra_m: int = 0) -> str:
    """ptxas's report on hopper_build, and the shared memory the launch asks for."""
    build = hopper_build(split, block_m, extra_m)
    return ptxas_report(build.asm["ptx"]) + f"shared memory: {build.metadata.shared} bytes\n"


@pytest.mark.skipif(not hopper.HAS_GLUON, reason="needs Triton's Gluon")
def test_hopper_build_keeps_the_products_in_flight():
    log = compiled_in_child("from tests.test_int4_gemm_hopper import hopper_ptxas_log\n"
                            "print(*(hopper_ptxas_log(split, *tile) for tile, split in (((8, 0), True), ((16, 0), True),"
                            " ((32, 0), True), ((64, 0), True), ((128, 0), False), ((128, 0), True), ((128, 32), False),"
                            " ((128, 32), True), ((256, 0), False), ((256, 0), True))))")
    assert log.count("Compiling entry function '_int4_gemm_hopper_kernel' for 'sm_90a'") == 10, log
    assert "C751" not in log and "serialized" not in log, log
    assert log.count("0 bytes spill stores") == 10, log
    # an H100 or H200 gives a program at most 227 KiB of shared memory
    assert max(int(size) for size in re.findall(r"shared memory: (\d+) bytes", log)) <= 227 * 1024, log
