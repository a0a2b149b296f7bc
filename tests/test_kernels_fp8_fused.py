"""RMSNorm and SiLU-and-mul writing float8 activations for an FP8 linear layer (rms_norm_quant,
silu_and_mul_quant), against the unfused kernels followed by the activation quantization kernel, and
against their torch twins (Triton's interpreter on the CPU in float32/float16; bfloat16 on CUDA).

Against the unfused kernels the result must be bit for bit the same in the interpreter: the same
16-bit value, then the same division and rounding (round_to_e4m3). Compiled for CUDA, the fused
RMSNorm may sum a row's squares in another order (Triton lays out the whole kernel anew), so a
16-bit value can move by an ulp: on an H100, 0 to 3 codes in a million moved by one e4m3 step
(2026-11-25), and float32 scales by a few ulps. Against the torch twins the 16-bit value may
differ by an ulp (rsqrt, exp and the order of the sum of squares differ between Triton and torch, as
in tests/test_kernels.py), which moves a code by at most one e4m3 step and a scale by at most one
16-bit ulp of the row's maximum (compared within two).
"""
import pytest
import torch

from nanovllm.kernels.fp8_primitives import FP8_DTYPE
from nanovllm.kernels.fp8_linear import QuantizedActivation, dequantize_ref, quantize_activation
from nanovllm.kernels.rms_norm import rms_norm, rms_norm_quant, rms_norm_quant_ref, rms_norm_ref
from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_quant, silu_and_mul_quant_ref
from tests.test_int4_gemm import compiled_in_child

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float32, torch.float16]
# one ulp relative (at most) of the 16-bit output; float32 outputs differ by a few ulps
ULP = {torch.float32: 2 ** -20, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
# a scale is a row's (group's) largest 16-bit value / 448: where that value moved by an ulp, the scale
# moves by up to 2^-10 (float16) relative, and the comparison itself rounds; so two ulps. A float32
# row normalised in another order moves by several float32 ulps (a sum of thousands of squares).
SCALE_RTOL = {torch.float32: 2 ** -16, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}
EPS = 1e-6
# (rows, columns, group): per token and 128-column group (last group partial), per token (group =
# columns, not a power of two), a group wider than the row, one row, groups over several tiles, a row
# of several per-token steps (ROW_CHUNK)
SMALL = [(5, 200, 128), (3, 96, 96), (33, 256, 64), (2, 64, 128), (1, 1000, 1000), (3, 2500, 128), (2, 2500, 2500)]
FULL = [(257, 4096, 128), (300, 4096, 4096), (1000, 5120, 128), (33, 9728, 9728), (64, 1536, 1536), (5, 200, 128),
        (2, 96, 96)]
SHAPES = FULL if CUDA else SMALL
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
shapes = pytest.mark.parametrize("rows,cols,group", SHAPES, ids=lambda v: str(v))


@pytest.fixture(autouse=True)
def poison_fresh_tensors(monkeypatch):
    """Fresh outputs hold NaN, so a code or scale the kernel never writes cannot pass."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype == FP8_DTYPE:
            t.view(torch.uint8).fill_(0x7F)      # e4m3fn's NaN
        elif t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


@pytest.fixture(autouse=True)
def fixed_seed():
    torch.manual_seed(0)


def assert_same_bits(actual: QuantizedActivation, q: torch.Tensor, scale: torch.Tensor, dtype) -> None:
    assert actual.q.dtype == FP8_DTYPE and actual.scale.dtype == torch.float32 and actual.dtype == dtype
    assert torch.equal(actual.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(actual.scale, scale)


def assert_same_as_unfused(actual: QuantizedActivation, q: torch.Tensor, scale: torch.Tensor, dtype) -> None:
    """Bit for bit in the interpreter; on CUDA codes within one step, at most 100 in a million moved
    (an H100 moved 0 to 3 in a million; a wrong group, scale or rounding moves far more)."""
    if not CUDA:
        return assert_same_bits(actual, q, scale, dtype)
    assert actual.q.dtype == FP8_DTYPE and actual.dtype == dtype
    torch.testing.assert_close(actual.scale, scale, rtol=SCALE_RTOL[dtype], atol=0)
    codes, unfused = actual.q.view(torch.uint8).int(), q.view(torch.uint8).int()
    assert (codes - unfused).abs().max().item() <= 1
    assert (codes != unfused).float().mean().item() <= 1e-4


def assert_near_twin(actual: QuantizedActivation, twin: QuantizedActivation, group: int) -> None:
    """Scales within two 16-bit ulps (float32: 2^-16) of the maximum; each value within one e4m3 step (2^-3 relative,
    2^-9 of the scale among the subnormals) after both scales; almost every code the same (as
    values: the kernels write +0 where torch writes -0)."""
    assert actual.q.shape == twin.q.shape and actual.scale.shape == twin.scale.shape
    torch.testing.assert_close(actual.scale, twin.scale, rtol=SCALE_RTOL[twin.dtype], atol=0)
    ours, theirs = dequantize_ref(actual.q, actual.scale, group), dequantize_ref(twin.q, twin.scale, group)
    step = 2 ** -3 * torch.maximum(ours.abs(), theirs.abs())
    step += 2 ** -9 * twin.scale.repeat_interleave(group, dim=1)[:, :ours.shape[1]]
    assert ((ours - theirs).abs() <= step * (1 + 2 * ULP[twin.dtype])).all()
    same = (actual.q.float() == twin.q.float()).float().mean().item()
    assert same >= 0.99, same


@dtypes
@shapes
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_quant_matches_the_unfused_kernels(rows, cols, group, residual, dtype):
    x = (torch.randn(rows, cols, device=DEVICE) * 3 + 0.5).to(dtype)
    weight = torch.randn(cols, device=DEVICE).to(dtype)
    res = torch.randn(rows, cols, device=DEVICE).to(dtype) if residual else None
    if residual:
        fused, fused_res = rms_norm_quant(x, weight, EPS, group, res.clone())
        out, out_res = rms_norm(x, weight, EPS, res.clone())
        assert torch.equal(fused_res, out_res)       # the 16-bit residual as the unfused norm leaves it
        twin, twin_res = rms_norm_quant_ref(x, weight, EPS, group, res.clone())
        assert torch.equal(twin_res, out_res)
    else:
        fused, out = rms_norm_quant(x, weight, EPS, group), rms_norm(x, weight, EPS)
        twin = rms_norm_quant_ref(x, weight, EPS, group)
    assert_same_as_unfused(fused, *quantize_activation(out, group), dtype)
    assert_near_twin(fused, twin, group)


@dtypes
@shapes
def test_silu_and_mul_quant_matches_the_unfused_kernels(rows, cols, group, dtype):
    x = (torch.randn(rows, 2 * cols, device=DEVICE) * 3).to(dtype)
    fused = silu_and_mul_quant(x, group)
    assert_same_as_unfused(fused, *quantize_activation(silu_and_mul(x), group), dtype)
    assert_near_twin(fused, silu_and_mul_quant_ref(x, group), group)


@pytest.mark.parametrize("chunk", [512, 1024])
def test_silu_and_mul_quant_holds_a_row_in_several_chunks(chunk, monkeypatch):
    """A per-token row of several chunks, the last one partial (3 of 1,024 or 5 of 512 columns at
    2,500: 16 and 32 warps), quantized with the scale of the whole row."""
    from nanovllm.kernels import silu_and_mul as silu_and_mul_module
    monkeypatch.setattr(silu_and_mul_module, "ROW_CHUNK", chunk)
    x = (torch.randn(3, 2 * 2500, device=DEVICE) * 3).to(torch.float16)
    x[1, 2400] = 40.0       # row 1's largest |y| in its last chunk
    fused = silu_and_mul_quant(x, 2500)
    assert_same_as_unfused(fused, *quantize_activation(silu_and_mul(x), 2500), torch.float16)
    assert_near_twin(fused, silu_and_mul_quant_ref(x, 2500), 2500)


def silu_quant_rows_ptxas_log(columns: int) -> str:
    """ptxas's report on the per-token SiLU-and-quantize kernel built for sm_90a as silu_and_mul_quant
    launches it for bfloat16 rows of `columns` (compiled without a GPU; outside the interpreter)."""
    from nanovllm.kernels import silu_and_mul as module
    from tests.test_int4_gemm import ptxas_report, sm90a_build
    chunk, chunks, warps = module.rows_launch(columns)
    build = sm90a_build(module._silu_and_mul_quant_rows_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32"),
                        dict(CHUNK=chunk, NUM_CHUNKS=chunks, PDL=True), ["x_ptr", "q_ptr", "N"], num_warps=warps)
    return ptxas_report(build.asm["ptx"])


def test_silu_and_mul_quant_rows_stay_in_registers():
    """Rows of 12,288 (Qwen3-8B), 14,336 (Llama 3 8B) and 25,600 columns (Qwen3-32B), 32 warps each, held
    whole by one program: built for sm_90a, nothing spills (a spilled row would go through local
    memory, the pass over L2 that the one-pass kernel removes)."""
    pytest.importorskip("triton")
    log = compiled_in_child("from tests.test_kernels_fp8_fused import silu_quant_rows_ptxas_log\n"
                            "print(*(silu_quant_rows_ptxas_log(n) for n in (12288, 14336, 25600)))")
    assert log.count("Compiling entry function '_silu_and_mul_quant_rows_kernel' for 'sm_90a'") == 3, log
    assert log.count("0 bytes spill stores") == 3, log


def test_twins_quantize_the_rounded_16_bit_output():
    """The scale is the 16-bit output's max |value| / 448 per group, a zero row gives zeros, and the
    codes dequantize to the 16-bit output within e4m3's precision."""
    x = torch.randn(3, 256, dtype=torch.float16) * torch.tensor([[1.0], [50.0], [0.0]], dtype=torch.float16)
    weight = torch.randn(256, dtype=torch.float16)
    quantized = rms_norm_quant_ref(x, weight, EPS, 128)
    out = rms_norm_ref(x, weight, EPS)
    assert quantized.dtype == torch.float16 and quantized.scale.shape == (3, 2)
    assert torch.equal(quantized.scale[:2], out[:2].float().abs().reshape(2, 2, 128).amax(-1) * (1 / 448))
    assert (quantized.q[2].float() == 0).all() and (quantized.scale[2] > 0).all()
    torch.testing.assert_close(dequantize_ref(quantized.q, quantized.scale, 128), out.float(),
                               rtol=2 ** -4, atol=quantized.scale.max().item() * 2 ** -9)
    gate_up = torch.randn(4, 2 * 96, dtype=torch.float16) * 4
    act = silu_and_mul_quant_ref(gate_up, 96)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(dequantize_ref(act.q, act.scale, 96), gate * torch.sigmoid(gate) * up,
                               rtol=2 ** -4 + 2 ** -9, atol=act.scale.max().item() * 2 ** -9)


def test_empty_batches():
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm_quant(x, torch.ones(64, device=DEVICE), EPS, 64).q.shape == (0, 64)
    assert silu_and_mul_quant(torch.empty(0, 128, device=DEVICE), 64).scale.shape == (0, 1)
