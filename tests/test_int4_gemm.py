"""The 4-bit GEMM of decode batches against int_gemm's torch twin (interpreter on the CPU: float32
and float16 through float32 dequantization; bfloat16 and float16 through the inline PTX on CUDA):
row and column tiles with partial edges, K split or not, groups of one step and of several; its PTX, emulated instruction by instruction (tests/test_int4_gemv.py's
run_ptx), dequantizes two words into q * s - z rounded once; built for sm_90a (no GPU needed), ptxas keeps
its matrix-core products in flight; the weight-only layer sends 17 rows up to DEQUANTIZE_FROM_ROWS
to it on CUDA."""

import os
import random
import subprocess
import sys
import tempfile

import pytest
import torch

from nanovllm.kernels import int4_gemm as int4_gemm_module
from nanovllm.kernels import int4_gemm_hopper
from nanovllm.kernels.int4_gemm import (CONFIG, FEW_ROWS_CONFIG, SMALL_CONFIG, Int4GemmConfig, dequantize_asm,
                                        gemm_supported, int4_gemm, launch_for)
from nanovllm.kernels.int_dequantize import DEQUANTIZE_FROM_ROWS
from nanovllm.kernels.int_gemm import int_gemm_ref
from tests.test_int4_gemv import (DEVICE, DTYPES, assert_layer_routes, assert_splits_leave_the_workspace_zero, awq_layer,
                                  pack_halves, packed_halves, run_ptx, tolerance)


def both(x, layer, group_size, config=None, split_k=None):
    args = (layer["qweight"], layer["scales"], layer["scaled_zeros"])
    return int4_gemm(x, *args, group_size, config=config, split_k=split_k), int_gemm_ref(x, *args, 4, group_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,split_k", [(1, 1), (65, 2), (130, 1), (130, 3)])
def test_matches_twin(dtype, rows, split_k):
    """130 rows: two row tiles of 64, the second partial; 200 columns: a partial column tile; K = 512
    split in 3: uneven runs of steps."""
    k, n, group_size = 512, 200, 128
    layer = awq_layer(k, n, group_size, dtype, seed=2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    out, ref = both(x, layer, group_size, Int4GemmConfig(64, 64, 4, 2), split_k)
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("group_size", [256, 512])      # two steps per group; one group (per channel)
def test_groups_of_several_steps_and_the_chosen_launch(group_size):
    k, n = 512, 96
    dtype = DTYPES[0]
    layer = awq_layer(k, n, group_size, dtype, seed=3)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    out, ref = both(x, layer, group_size)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("rows", [20, 40, 70])
@pytest.mark.parametrize("k,n", [(128, 520), (512, 96)])
def test_the_chosen_launches_up_to_128_rows(k, n, rows):
    """Outputs of 4x the inputs: partial column tiles, K one step; inputs of 5x the outputs: K split
    in four, one step each; 20 rows on the 64 x 32 tiles, 40 on the 64 x 64, 70 on the 128 x 128."""
    dtype = DTYPES[0]
    layer = awq_layer(k, n, 128, dtype, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    out, ref = both(x, layer, 128)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


def test_split_k_leaves_its_workspace_zero():
    assert_splits_leave_the_workspace_zero(both, (70, 66), Int4GemmConfig(32, 64, 4, 2))


def test_launch_choice():
    """Up to 32 rows 64 x 32 tiles, up to 64 rows 64 x 64, K split in four; then 128 x 128 tiles, K
    split in four up to 128 rows and in two above where K >= N (few column tiles), in two and not at
    all above where K < N; outputs of 4x the inputs keep K whole up to 128 rows."""
    assert launch_for(17, 4096, 4096) == (SMALL_CONFIG, 4) and launch_for(32, 4096, 12288) == (SMALL_CONFIG, 4)
    assert launch_for(32, 24576, 4096) == (SMALL_CONFIG, 1)
    assert launch_for(33, 4096, 4096) == (FEW_ROWS_CONFIG, 4) and launch_for(64, 6144, 4096) == (FEW_ROWS_CONFIG, 4)
    assert launch_for(64, 24576, 4096) == (FEW_ROWS_CONFIG, 1)
    assert launch_for(65, 4096, 4096) == (CONFIG, 4) and launch_for(100, 4096, 12288) == (CONFIG, 4)
    assert launch_for(128, 6144, 4096) == (CONFIG, 2) and launch_for(128, 24576, 4096) == (CONFIG, 1)
    assert launch_for(129, 4096, 4096) == (CONFIG, 2) and launch_for(256, 24576, 4096) == (CONFIG, 1)
    assert (SMALL_CONFIG.block_n, SMALL_CONFIG.block_m) == (64, 32)
    assert FEW_ROWS_CONFIG.block_n == FEW_ROWS_CONFIG.block_m == 64 and CONFIG.block_n == CONFIG.block_m == 128


def sm90a_build(kernel, pointers: dict[str, str], constants: dict, aligned: list[str], **options):
    """A Triton kernel compiled for sm_90a without a GPU (outside the interpreter: tests run this in a
    child, compiled_in_child): `pointers` gives the pointer arguments' types (the rest are int32),
    `constants` the constexprs, `aligned` the arguments known to be multiples of 16; `options` are the
    launch's (num_warps, num_stages). The result holds the PTX (.asm["ptx"]) and .metadata."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile
    index = {name: i for i, name in enumerate(kernel.arg_names)}
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(pointers, **{name: "constexpr" for name in constants})
    source = ASTSource(kernel, signature, {(index[name],): value for name, value in constants.items()},
                       attrs={(index[name],): [["tt.divisibility", 16]] for name in aligned})
    return triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def hopper_ptxas_log(config: Int4GemmConfig, split: bool) -> str:
    """ptxas's report on _int4_gemm_kernel built for sm_90a as int4_gemm launches it for bfloat16
    (Triton compiles for a target without a GPU and its own ptxas assembles)."""
    constants = dict(GROUP_SIZE=128, BLOCK_N=config.block_n, BLOCK_M=config.block_m, SPLIT=split,
                     ASM_LOW=dequantize_asm(torch.bfloat16, 0), ASM_HIGH=dequantize_asm(torch.bfloat16, 4),
                     USE_PTX=True, INPUT_PRECISION=None, NUM_STAGES=config.num_stages)
    pointers = dict(x_ptr="*bf16", qweight_ptr="*i32", scales_ptr="*bf16", zeros_ptr="*bf16", out_ptr="*bf16",
                    partial_ptr="*fp32", arrivals_ptr="*i32")
    build = sm90a_build(int4_gemm_module._int4_gemm_kernel, pointers, constants, [*pointers, "N", "K", "K_PER_SPLIT"],
                        num_warps=config.num_warps)
    return ptxas_report(build.asm["ptx"])


def ptxas_report(ptx: str) -> str:
    """What Triton's ptxas says (-v) assembling this PTX for sm_90a: registers, spills, serialized wgmma."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".cubin"],
                             capture_output=True, text=True, check=True)
    return run.stdout + run.stderr


def compiled_in_child(script: str) -> str:
    """What a child Python running `script` from the repository root prints: kernels are built there
    outside Triton's interpreter, which this process may have switched on."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout


def test_hopper_build_keeps_the_products_in_flight():
    """ptxas may serialize wgmma (each product waits for the one before): it did for every launch
    while the K loop could run zero times (the sums' zeros set again on the path around it)."""
    log = compiled_in_child("from tests.test_int4_gemm import CONFIG, FEW_ROWS_CONFIG, SMALL_CONFIG, hopper_ptxas_log\n"
                            "print(hopper_ptxas_log(CONFIG, False), hopper_ptxas_log(FEW_ROWS_CONFIG, True), "
                            "hopper_ptxas_log(SMALL_CONFIG, True))")
    assert log.count("Compiling entry function '_int4_gemm_kernel' for 'sm_90a'") == 3, log
    assert "C7515" not in log and "serialized" not in log, log
    assert log.count("0 bytes spill stores") == 3, log


@pytest.mark.parametrize("first_row", [0, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ptx_dequantizes_two_words(dtype, first_row):
    """dequantize_asm: output j holds row first_row + j of a (low half) and of b (high half) as
    q * s - z in dtype, rounded once, for the column's scale and negated zero pairs ($6, $7)."""
    asm = dequantize_asm(dtype, first_row)
    rng = random.Random(0)
    for trial in range(40):
        a, b = rng.getrandbits(32), rng.getrandbits(32)
        if trial == 0:
            a, b = 0, 0xFFFFFFFF
        s = torch.tensor([rng.uniform(1e-3, 2e-2), rng.uniform(1e-3, 2e-2)]).to(dtype)
        z = (torch.tensor([rng.randrange(16), rng.randrange(16)]) * s.float()).to(dtype)
        outs = run_ptx(asm, a, b, pack_halves(s), pack_halves(-z), outputs=4)
        for i, out in enumerate(outs, start=first_row):
            q = torch.tensor([(a >> 4 * i) & 0xF, (b >> 4 * i) & 0xF]).double()
            expected = (q * s.double() - z.double()).to(dtype)
            assert torch.equal(packed_halves(out, dtype), expected), (hex(a), hex(b), i)


def test_supported_layers():
    assert gemm_supported(4096, 128, None, 4) and gemm_supported(4096, 4096, None, 4)
    assert not gemm_supported(4096, 64, None, 4)        # a step of 128 rows spans two groups
    assert not gemm_supported(4096, 128, None, 8)
    assert not gemm_supported(4096, 128, torch.arange(4096) // 128, 4)     # act order
    with pytest.raises(ValueError, match="group_size"):
        layer = awq_layer(256, 32, 64, DTYPES[0])
        int4_gemm(torch.zeros(70, 256, device=DEVICE, dtype=DTYPES[0]), layer["qweight"], layer["scales"],
                  layer["scaled_zeros"], 64)


@pytest.mark.skipif(DEVICE != "cuda", reason="the layer sends work to the Triton kernels on CUDA only")
@pytest.mark.parametrize("rows,expect_gemm", [(16, False), (17, True), (DEQUANTIZE_FROM_ROWS - 1, True),
                                              (DEQUANTIZE_FROM_ROWS, False)])
def test_weight_only_layer_routes_decode_batches_to_the_gemm(monkeypatch, rows, expect_gemm):
    on_hopper = int4_gemm_hopper.takes(torch.zeros(rows, 256, dtype=torch.bfloat16, device=DEVICE))
    assert_layer_routes(monkeypatch, "int4_gemm", rows, expect_gemm and not on_hopper)   # there its Gluon twin
