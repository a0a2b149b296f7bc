"""The few-row 4-bit GEMV against int_gemm's torch twin (interpreter on the CPU: float32, and
float16 through the same bit patterns the GPU builds; bfloat16 and float16 through the inline PTX
on CUDA), with and without split K, odd row counts, group sizes above one step, per-channel groups;
the 16-bit patterns it builds are the floats OFFSET + q, and its PTX (emulated here instruction by
instruction, as the PTX ISA defines prmt, shr and lop3) builds them from two words; the weight-only
layer picks the GEMV only where it applies."""

import random
import re

import pytest
import torch

from nanovllm.kernels import int4_gemv as int4_gemv_module
from nanovllm.kernels.int4_gemv import (F32_ROW_OFFSETS, MAGIC, ONE_ROW_CONFIG, WIDE_ONE_ROW_CONFIG, Int4GemvConfig,
                                        gemv_supported, int4_gemv, unpack_asm, unpack_f32_asm)
from nanovllm.kernels.int_gemm import int_gemm_ref
from nanovllm.quantization.int_packing import awq_for_gemm, gptq_for_gemm
from nanovllm.checkpoints.quantized_checkpoint import quantize_awq, quantize_gptq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16]


def awq_layer(k: int, n: int, group_size: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5
    t = quantize_awq(w, group_size)
    return {name: v.to(DEVICE) for name, v in awq_for_gemm(t["qweight"], t["qzeros"], t["scales"], dtype).items()}


def both(x, layer, group_size, config=None, split_k=None):
    args = (layer["qweight"], layer["scales"], layer["scaled_zeros"])
    return int4_gemv(x, *args, group_size, config=config, split_k=split_k), int_gemm_ref(x, *args, 4, group_size)


def tolerance(dtype):
    # float32 (interpreter): one row's odd rows are summed under an offset of 2048 (int4_gemv.F32_ROW_OFFSETS),
    # which costs about a tenth of a bfloat16 rounding (errors up to 5e-4 on outputs of about 1)
    return dict(rtol=0, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 19])
def test_matches_twin(dtype, rows):
    k, n, group_size = 512, 200, 128      # 200 columns: a partial column tile
    layer = awq_layer(k, n, group_size, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    for split_k in (1, 3):
        out, ref = both(x, layer, group_size, split_k=split_k)
        assert out.dtype == dtype and out.shape == (rows, n)
        torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("group_size,config", [(256, Int4GemvConfig(64, 128, 4, 2)),      # two steps per group
                                               (256, Int4GemvConfig(32, 256, 2, 3)),      # one step per group
                                               (512, Int4GemvConfig(128, 128, 4, 2))])    # one group: per channel
def test_group_sizes_and_launch_shapes(group_size, config, monkeypatch):
    """Also one row, both ways: the 16-row tile (a layer this small) and element-wise."""
    k, n = 512, 96
    dtype = DTYPES[0]
    layer = awq_layer(k, n, group_size, dtype, seed=1)
    for rows, min_weights in ((1, int4_gemv_module.ONE_ROW_MIN_WEIGHTS), (1, 0), (3, 0)):
        monkeypatch.setattr(int4_gemv_module, "ONE_ROW_MIN_WEIGHTS", min_weights)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
        for split_k in (None, 2):
            out, ref = both(x, layer, group_size, config, split_k)
            torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("block_m,rows", [(32, 40), (64, 70)])
def test_tiles_of_more_rows(block_m, rows):
    """Tiles of 32 and 64 rows (each weight unpacked once for all of them): partial row and column
    tiles, with and without split K."""
    k, n = 256, 72
    dtype = DTYPES[0]
    layer = awq_layer(k, n, 128, dtype, seed=2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    for split_k in (1, 2):
        out, ref = both(x, layer, 128, Int4GemvConfig(64, 128, 4, 2, block_m=block_m), split_k)
        torch.testing.assert_close(out, ref, **tolerance(dtype))


# the one-row launch before ONE_ROW_CONFIG: single-warp programs in sub-steps of 2 words
TWO_WORD_SUB_STEPS = Int4GemvConfig(64, 128, 1, 1, sub_words=2)


@pytest.mark.parametrize("config", [ONE_ROW_CONFIG, WIDE_ONE_ROW_CONFIG, TWO_WORD_SUB_STEPS,
                                    Int4GemvConfig(32, 128, 1, 1, sub_words=4),
                                    Int4GemvConfig(64, 128, 2, 1, sub_words=16)],
                         ids=["one-row", "wide", "sub2", "sub4", "sub16"])
def test_one_row_sub_steps(config, monkeypatch):
    """One row element-wise (here for layers of any size) in sub-steps of 2, 4, 8 or all 16 words of
    a step, in programs of one or two warps, and as the layer's size picks (wide from 40M weights)."""
    monkeypatch.setattr(int4_gemv_module, "ONE_ROW_MIN_WEIGHTS", 0)
    dtype = DTYPES[0]
    for k, n in ((256, 200), (128, 520), (128, 512)):     # partial column tiles, then none (unmasked loads)
        layer = awq_layer(k, n, 128, dtype, seed=k)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
        for split_k in (None, 2):
            out, ref = both(x, layer, 128, config, split_k)
            torch.testing.assert_close(out, ref, **tolerance(dtype))
    for wide_min_weights in (int4_gemv_module.WIDE_ONE_ROW_MIN_WEIGHTS, 0):   # the launch the layer's size picks
        monkeypatch.setattr(int4_gemv_module, "WIDE_ONE_ROW_MIN_WEIGHTS", wide_min_weights)
        out, ref = both(x, layer, 128)
        torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("rows,min_weights,config,columns", [
    (1, 0, ONE_ROW_CONFIG, 256), (1, 0, WIDE_ONE_ROW_CONFIG, 256), (1, 0, TWO_WORD_SUB_STEPS, 72),
    (1, None, None, 72), (3, None, None, 72), (40, None, None, 72)],
    ids=["one-row", "wide", "sub2", "tile-one-row", "tile", "tile-of-32-rows"])
def test_gated_is_the_product_then_silu_and_mul(rows, min_weights, config, columns, monkeypatch):
    """gated=True on a merged [gate; up] layer (gate columns 0..N/2, up N/2..N): silu(gate) * up
    from the epilogue, split K or not, bit for bit the unfused GEMV followed by the silu_and_mul
    kernel, and close to the twins."""
    from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
    if min_weights is not None:
        monkeypatch.setattr(int4_gemv_module, "ONE_ROW_MIN_WEIGHTS", min_weights)
    dtype = DTYPES[0]
    k, n = 256, 2 * columns        # of each: 72 leaves partial column tiles, 256 none (unmasked loads)
    layer = awq_layer(k, n, 128, dtype, seed=9)
    args = (layer["qweight"], layer["scales"], layer["scaled_zeros"], 128)
    # x in quarters: every product-sum of the tiles is exact, so their order (the interpreter's dots
    # are numpy's, which sums differently for other column sets on some CPUs) cannot move a bit
    x = (torch.randint(-8, 8, (rows, k), generator=torch.Generator().manual_seed(10)) / 4).to(DEVICE, dtype)
    for split_k in (1, 2):
        fused = int4_gemv(x, *args, config=config, split_k=split_k, gated=True)
        assert fused.shape == (rows, n // 2) and fused.dtype == dtype
        unfused = int4_gemv(x, *args, config=config, split_k=split_k)
        torch.testing.assert_close(fused, silu_and_mul(unfused), rtol=0, atol=0)
        torch.testing.assert_close(fused, silu_and_mul_ref(int_gemm_ref(x, *args[:3], 4, 128)), **tolerance(dtype))


def test_gptq_layout_matches_twin():
    k, n, group_size = 256, 64, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2)) / k ** 0.5
    t = quantize_gptq(w, 4, group_size, None)
    layer = {name: v.to(DEVICE) for name, v in
             gptq_for_gemm(t["qweight"], t["qzeros"], t["scales"], 4, True, torch.float16).items()}
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    out, ref = both(x, layer, group_size)
    torch.testing.assert_close(out, ref, **tolerance(torch.float16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_magic_halves_are_offset_plus_q(dtype):
    """What the PTX builds: a 16-bit half MAGIC | q is the float OFFSET + q (exact in 16 bits)."""
    bits, offset = MAGIC[dtype]
    q = torch.arange(16, dtype=torch.int16)
    assert torch.equal((q | bits).view(dtype).float(), q.float() + offset)


def packed_halves(value: int, dtype: torch.dtype) -> torch.Tensor:
    """A 32-bit register as its two 16-bit floats (low half first)."""
    return torch.tensor([value & 0xFFFF, value >> 16], dtype=torch.int32).to(torch.int16).view(dtype)


def pack_halves(halves: torch.Tensor) -> int:
    bits = halves.view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


PACKED_FLOATS = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}


def run_ptx(asm: str, a: int, b: int = 0, c: int = 0, d: int = 0, outputs: int = 8) -> list[int]:
    """The outputs ($0 ..) of a PTX program of this package for the input registers a, b, c and d
    (numbered after the outputs), unsigned 32-bit: int4_gemv's unpack_asm and unpack_f32_asm (8
    outputs), int4_gemm's dequantize_asm (4). Packed 16-bit float arithmetic is computed exactly
    (float64) and rounded once."""
    regs = {f"${outputs + i}": v for i, v in enumerate((a, b, c, d))}
    value = lambda operand: regs[operand] if operand in regs else int(operand, 0)
    pattern = r"(prmt\.b32|shr\.u32|shr\.b32|shl\.b32|lop3\.b32|mov\.b32|sub\.rn\.\w+|fma\.rn\.\w+) (.+);"
    instructions = [re.fullmatch(pattern, line.strip()) for line in asm.splitlines()]
    assert sum(map(bool, instructions)) == sum(line.strip().endswith(";") for line in asm.splitlines() if
                                               not line.strip().startswith(".reg"))   # every instruction known
    for op, operands in [m.groups() for m in instructions if m]:
        dest, *src = [t.strip() for t in operands.split(",")]
        v = [value(x) for x in src]
        if op == "prmt.b32":   # byte i of the result: byte (selector nibble i) of the 8 bytes b:a
            pool = (v[1] << 32) | v[0]
            regs[dest] = sum(((pool >> (8 * ((v[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op in ("shr.u32", "shr.b32"):     # logical: zeros shift in
            regs[dest] = v[0] >> v[1]
        elif op == "shl.b32":
            regs[dest] = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "mov.b32":
            regs[dest] = v[0]
        elif op.startswith(("sub.rn.", "fma.rn.")):     # per 16-bit half, one rounding
            dtype = PACKED_FLOATS[op.split(".")[-1]]
            h = [packed_halves(x, dtype).double() for x in v]
            exact = h[0] - h[1] if op.startswith("sub") else h[0] * h[1] + h[2]
            regs[dest] = pack_halves(exact.to(dtype))
        else:                  # bit j of the result: bit (a_j b_j c_j as a 3-bit number) of the table
            regs[dest] = sum(((v[3] >> (((v[0] >> j) & 1) << 2 | ((v[1] >> j) & 1) << 1 | ((v[2] >> j) & 1))) & 1) << j
                             for j in range(32))
    return [regs[f"${i}"] for i in range(outputs)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ptx_turns_two_words_into_their_rows(dtype):
    bits, offset = MAGIC[dtype]
    asm = unpack_asm(bits)
    rng = random.Random(0)
    for a, b in [(0, 0xFFFFFFFF), (0x76543210, 0xFEDCBA98)] + [(rng.getrandbits(32), rng.getrandbits(32))
                                                               for _ in range(50)]:
        for i, out in enumerate(run_ptx(asm, a, b)):
            halves = packed_halves(out, dtype)
            expected = torch.tensor([(a >> 4 * i) & 0xF, (b >> 4 * i) & 0xF]).float() + offset
            assert torch.equal(halves.float(), expected), (hex(a), hex(b), i)


def test_f32_ptx_turns_a_word_into_its_rows():
    """unpack_f32_asm: row i of the word as the float32 offset + q, 128 for even rows, 2048 for odd."""
    rng = random.Random(1)
    for a in [0, 0xFFFFFFFF, 0x76543210, 0x89ABCDEF] + [rng.getrandbits(32) for _ in range(50)]:
        rows = torch.tensor(run_ptx(unpack_f32_asm(), a), dtype=torch.int64).to(torch.int32).view(torch.float32)
        expected = [((a >> 4 * i) & 0xF) + F32_ROW_OFFSETS[i] for i in range(8)]
        assert rows.tolist() == expected, hex(a)


def test_supported_layers():
    assert gemv_supported(4096, 128, None, 4)
    assert gemv_supported(4096, 4096, None, 4)           # per channel: one group
    assert not gemv_supported(4096, 64, None, 4)         # a step of 16 words spans several groups
    assert not gemv_supported(4096, 128, None, 8)
    assert not gemv_supported(4096, 128, torch.arange(4096) // 128, 4)     # act order
    with pytest.raises(ValueError, match="group_size"):
        x = torch.zeros(1, 256, device=DEVICE, dtype=DTYPES[0])
        layer = awq_layer(256, 32, 64, DTYPES[0])
        int4_gemv(x, layer["qweight"], layer["scales"], layer["scaled_zeros"], 64)


@pytest.mark.skipif(DEVICE != "cuda", reason="the layer sends work to the GEMV on CUDA only (the CPU runs the twin)")
@pytest.mark.parametrize("rows,expect_gemv", [(1, True), (8, True), (16, True), (17, False), (33, False)])
def test_weight_only_layer_routes_few_rows_to_the_gemv(monkeypatch, rows, expect_gemv):
    from nanovllm.kernels import int4_gemm_hopper
    on_hopper = int4_gemm_hopper.takes(torch.zeros(rows, 256, dtype=torch.bfloat16, device=DEVICE))
    assert_layer_routes(monkeypatch, "int4_gemv", rows, expect_gemv and not on_hopper)   # there its Gluon GEMM


def assert_layer_routes(monkeypatch, kernel: str, rows: int, expect_kernel: bool) -> None:
    """Whether an AWQ layer's product of `rows` rows goes through weight_only's `kernel`, and that it
    matches the twin either way."""
    from nanovllm.quantization import weight_only
    from nanovllm.quantization.awq import AWQLinearMethod
    calls, run = [], getattr(weight_only, kernel)
    monkeypatch.setattr(weight_only, kernel, lambda *a, **kw: calls.append(1) or run(*a, **kw))
    layer = torch.nn.Module()
    for name, t in awq_layer(256, 64, 128, torch.bfloat16).items():
        setattr(layer, name, t)
    layer.group_size, layer.g_idx = 128, None
    x = torch.randn(rows, 256, device=DEVICE, dtype=torch.bfloat16)
    out = AWQLinearMethod(128).apply(layer, x)
    assert bool(calls) == expect_kernel
    torch.testing.assert_close(out, int_gemm_ref(x, layer.qweight, layer.scales, layer.scaled_zeros, 4, 128),
                               rtol=2e-2, atol=2e-2)


def assert_splits_leave_the_workspace_zero(both, rows: tuple[int, int], config) -> None:
    """The last split of each tile writes the output and clears the sums and arrival counts, so
    the next call (another shape, then the first again) starts from zeros. `both(x, layer, group,
    config, split_k)` -> (kernel's output, twin's)."""
    from nanovllm.kernels.zeroed_workspace import zeroed_workspace
    dtype = DTYPES[0]
    small, large = awq_layer(256, 48, 128, dtype, seed=5), awq_layer(512, 96, 128, dtype, seed=6)
    x_small = torch.randn(rows[0], 256, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    x_large = torch.randn(rows[1], 512, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    workspace_is_zero = lambda: not any(zeroed_workspace(x_small.device, kind, 0).any()
                                        for kind in (torch.float32, torch.int32))
    first, ref = both(x_small, small, 128, config, split_k=2)
    torch.testing.assert_close(first, ref, **tolerance(dtype))
    assert workspace_is_zero()
    out, ref = both(x_large, large, 128, None, split_k=4)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    assert torch.equal(both(x_small, small, 128, config, split_k=2)[0], first)
    assert workspace_is_zero()


def test_split_k_leaves_its_workspace_zero():
    assert_splits_leave_the_workspace_zero(both, (3, 2), Int4GemvConfig(16, 128, 4, 2))


@pytest.mark.parametrize("rows", [1, 3])
def test_left_sums_are_finished_and_cleared_by_the_residual_norm(rows, monkeypatch):
    """leave_sums: the splits' float32 sums stay in the workspace (no program finishes them); the
    residual RMSNorm then gives what it gives on the finished output, and leaves the workspace zero."""
    from nanovllm.kernels.rms_norm import rms_norm
    from nanovllm.kernels.zeroed_workspace import PendingSums, zeroed_workspace
    monkeypatch.setattr(int4_gemv_module, "ONE_ROW_MIN_WEIGHTS", 0)     # one row: the element-wise path
    dtype = DTYPES[-1]      # float16: the norm rounds the sums to it, as the finishing program would
    k, n, group_size = 512, 256, 128
    layer = awq_layer(k, n, group_size, dtype, seed=7)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    args = (layer["qweight"], layer["scales"], layer["scaled_zeros"], group_size)
    finished = int4_gemv(x, *args, split_k=4)
    pending = int4_gemv(x, *args, split_k=4, leave_sums=True)
    assert isinstance(pending, PendingSums) and pending.dtype == dtype and pending.sums.shape == (rows, n)
    torch.testing.assert_close(pending.sums.to(dtype), finished, rtol=0, atol=1e-3)
    weight = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    residual = torch.randn(rows, n, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    expected = rms_norm(pending.sums.to(dtype), weight, 1e-6, residual.clone())
    out, new_residual = rms_norm(pending, weight, 1e-6, residual.clone())
    assert torch.equal(out, expected[0]) and torch.equal(new_residual, expected[1])
    assert not zeroed_workspace(x.device, torch.float32, 0).any()
    assert int4_gemv(x, *args, split_k=1, leave_sums=True).dtype == dtype    # nothing split: finished as usual


def pending_norm_ptx() -> str:
    """The PTX of rms_norm's kernel finishing PendingSums of 4,096 columns (the 8B shape's hidden
    size, eight warps), built for sm_90a as a decode step at one row launches it."""
    from nanovllm.kernels.rms_norm import _rms_norm_kernel
    from tests.test_int4_gemm import sm90a_build
    constants = dict(NUM_HEADS=1, N=4096, BLOCK=4096, ROWS=1, HAS_RESIDUAL=True, QUANT_GROUP=0, NUM_GROUPS=1,
                     PDL=True, PENDING_SUMS=True)
    pointers = dict(x_ptr="*fp32", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", scale_ptr="*fp32",
                    eps="fp32")
    return sm90a_build(_rms_norm_kernel, pointers, constants, ["x_ptr", "residual_ptr", "weight_ptr", "out_ptr",
                                                               "stride_x_row"], num_warps=8).asm["ptx"]


def test_pending_sums_are_read_by_every_warp_before_any_clears_them():
    """rms_norm clears the float32 sums it reads. Triton stores the zeros in another thread layout than
    it loads the sums (each thread 8 columns, then 4), so one warp would clear columns another has
    yet to read unless a barrier stands between: a race no CPU run can show, so this reads the built
    kernel. Its first global store must come after a barrier."""
    from tests.test_int4_gemm import compiled_in_child
    ptx = compiled_in_child("from tests.test_int4_gemv import pending_norm_ptx\nprint(pending_norm_ptx())")
    assert "st.global" in ptx and "bar.sync" in ptx[:ptx.index("st.global")], ptx
