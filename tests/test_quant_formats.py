"""AWQ and GPTQ tensors as the published tools write them, and our writers and dequantizers.

Where each detail was checked (read from the sources, not copied):
- AWQ nibble order (0, 2, 4, 6, 1, 3, 5, 7), qweight [in, out/8], qzeros [in/g, out/8] packed the
  same way, scales fp16 [in/g, out], w = (q - z) * s: AutoAWQ awq/modules/linear/gemm.py
  (WQLinear_GEMM.__init__ and from_linear) and vLLM quantization/utils/quant_utils.py.
- AWQ round-to-nearest grid (zero point, s = (max - min).clamp(1e-5) / 15, z = -round(min / s)):
  AutoAWQ awq/quantize/quantizer.py (pseudo_quantize_tensor). config.json keys (quant_method,
  zero_point, group_size, bits, version "gemm", modules_to_not_convert): awq/models/_config.py
  (to_transformers_dict).
- GPTQ qweight [in*bits/32, out] with 32/bits consecutive input rows per word, low bits first;
  qzeros [groups, out*bits/32] packed along the output columns: GPTQModel
  nn_modules/qlinear/__init__.py (pack_block). checkpoint_format "gptq" (v1, GPTQModel's default
  save format) stores zeros - 1, "gptq_v2" the zeros: GPTQModel utils/model.py
  (convert_gptq_v2_to_v1_format_module subtracts 0x11111111 for 4 bits) and vLLM gptq.py
  (use_v2_format). Symmetric zero (maxq + 1) / 2 and s = 2 * max|w| / maxq: GPTQModel
  quantization/quantizer.py (find_params). g_idx of act-order (desc_act) checkpoints: the
  position in the sorted order // group_size, then un-permuted: quantization/gptq.py. Projections of
  one input (q/k/v, gate/up) share the order, as they share the Hessian.
"""
import json

import pytest
import torch

from nanovllm.quantization.int_packing import (AWQ_PACK_ORDER, awq_for_gemm, dequantize_awq, dequantize_gptq,
                                               gptq_for_gemm, pack_columns, pack_rows, unpack_columns,
                                               unpack_rows)
from nanovllm.kernels.int_gemm import dequantize_packed, from_step_order, in_step_order, to_step_order
from nanovllm.checkpoints.quantized_checkpoint import (act_order, quantize_awq, quantize_gptq, write_awq_checkpoint,
                                                 write_dequantized_checkpoint, write_gptq_checkpoint)


def as_uint32(x: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in x.reshape(-1).tolist()]


def test_awq_packs_eight_columns_in_interleaved_order():
    q = torch.arange(1, 9, dtype=torch.int32).reshape(1, 8)            # columns 0..7 hold 1..8
    # nibbles from the lowest: columns 0, 2, 4, 6, 1, 3, 5, 7 -> 1, 3, 5, 7, 2, 4, 6, 8
    assert as_uint32(pack_columns(q, 4, AWQ_PACK_ORDER)) == [0x86427531]
    assert torch.equal(unpack_columns(pack_columns(q, 4, AWQ_PACK_ORDER), 4, AWQ_PACK_ORDER), q)


def test_gptq_packs_consecutive_rows_low_bits_first():
    q = torch.arange(1, 9, dtype=torch.int32).reshape(8, 1)
    assert as_uint32(pack_rows(q, 4)) == [0x87654321]
    q8 = torch.tensor([[0x12], [0x34], [0xAB], [0xFF]], dtype=torch.int32)
    assert as_uint32(pack_rows(q8, 8)) == [0xFFAB3412]
    assert torch.equal(unpack_rows(pack_rows(q8, 8), 8), q8)


@pytest.mark.parametrize("bits", [4, 8])
def test_random_round_trips(bits):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 1 << bits, (64, 40), generator=g, dtype=torch.int32)
    assert torch.equal(unpack_rows(pack_rows(q, bits), bits), q)
    assert torch.equal(unpack_columns(pack_columns(q, bits), bits), q)


def autoawq_pseudo_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ's fake quantization of w [out, in] (zero point, 4 bits), written from its formula."""
    groups = w.reshape(-1, group_size)
    high, low = groups.amax(dim=1, keepdim=True), groups.amin(dim=1, keepdim=True)
    scales = ((high - low).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(low / scales)).clamp(0, 15)
    return ((torch.clamp(torch.round(groups / scales) + zeros, 0, 15) - zeros) * scales).reshape(w.shape)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_writer_shapes_and_values(group_size):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    t = quantize_awq(w, group_size)
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (256, 6)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (256 // group_size, 6)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (256 // group_size, 48)
    deq = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], group_size)
    torch.testing.assert_close(deq, autoawq_pseudo_quantize(w.half().float(), group_size), rtol=0, atol=1e-6)
    step = t["scales"].float().repeat_interleave(group_size, 0).t()
    assert ((deq - w).abs() <= step * 0.5 + 1e-3).all()


@pytest.mark.parametrize("bits,group_size,desc_act", [(4, 32, False), (4, 64, True), (8, 128, False),
                                                      (8, 32, True), (4, -1, False)])
def test_gptq_writer_shapes_and_values(bits, group_size, desc_act):
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    order = act_order("model.layers.0.mlp.down_proj.weight", 128) if desc_act else None
    t = quantize_gptq(w, bits, group_size, order)
    groups = 1 if group_size == -1 else 128 // group_size
    assert t["qweight"].shape == (128 * bits // 32, 40) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (groups, 40 * bits // 32) and t["qzeros"].dtype == torch.int32
    assert t["scales"].shape == (groups, 40) and t["scales"].dtype == torch.float16
    assert t["g_idx"].shape == (128,) and t["g_idx"].dtype == torch.int32
    # v1 stores zeros - 1: 7 in every nibble for 4 bits, 127 in every byte for 8
    assert set(as_uint32(t["qzeros"])) == {0x77777777 if bits == 4 else 0x7F7F7F7F}
    size = 128 if group_size == -1 else group_size
    assert torch.bincount(t["g_idx"].long()).tolist() == [size] * groups
    assert (t["g_idx"].diff() >= 0).all() != desc_act        # act order: groups are not runs of rows
    deq = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    step = t["scales"].float()[t["g_idx"].long()].t()
    err = (deq - w.half().float()).abs()
    # the symmetric grid runs from -zero to maxq - zero (-8..7 for 4 bits): only the top end clips
    inside = w.half().float() <= ((1 << bits) // 2 - 0.5) * step
    assert (err[inside] <= step[inside] * 0.5 + 1e-6).all() and (err <= step + 1e-6).all()
    v2 = quantize_gptq(w, bits, group_size, order, zeros_minus_one=False)
    torch.testing.assert_close(dequantize_gptq(v2["qweight"], v2["qzeros"], v2["scales"], v2["g_idx"], bits,
                                               zeros_minus_one=False), deq, rtol=0, atol=0)


def test_step_order_puts_row_16i_plus_r_in_word_r_bits_4i():
    """The layout's step order (4 bits, groups of whole steps of 128 rows, no act order)."""
    q = torch.randint(0, 16, (256, 3), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    words = pack_rows(to_step_order(q), 4)
    for step in (0, 1):
        for r in range(16):
            for i in range(8):
                assert torch.equal((words[16 * step + r] >> (4 * i)) & 0xF, q[128 * step + 16 * i + r])
    assert torch.equal(from_step_order(to_step_order(q)), q)
    assert in_step_order(256, 4, 128, False) and in_step_order(256, 4, 256, False)
    assert not (in_step_order(256, 4, 64, False) or in_step_order(256, 8, 128, False)
                or in_step_order(256, 4, 128, True) or in_step_order(384, 4, 256, False))


@pytest.mark.parametrize("group_size", [32, 128])     # plain order, step order
def test_gemm_layout_matches_the_dequantizers(group_size):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    a = quantize_awq(w, group_size)
    packed = awq_for_gemm(a["qweight"], a["qzeros"], a["scales"], torch.float32)
    torch.testing.assert_close(
        dequantize_packed(packed["qweight"], packed["scales"], packed["scaled_zeros"], 4, group_size),
        dequantize_awq(a["qweight"], a["qzeros"], a["scales"], group_size).t(), rtol=0, atol=1e-6)
    for bits in (4, 8):
        for order in (None, act_order("x.weight", 256)):
            g = quantize_gptq(w, bits, group_size, order)
            packed = gptq_for_gemm(g["qweight"], g["qzeros"], g["scales"], bits, True, torch.float32,
                                   act_order=order is not None)
            g_idx = g["g_idx"] if order is not None else None
            torch.testing.assert_close(
                dequantize_packed(packed["qweight"], packed["scales"], packed["scaled_zeros"], bits, group_size, g_idx),
                dequantize_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"], bits).t(), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def source_model(tmp_path_factory):
    from nanovllm.checkpoints.random_checkpoint import write_tiny_model
    return write_tiny_model(str(tmp_path_factory.mktemp("dense")), seed=3)


def test_written_checkpoints_are_laid_out_like_the_hubs(source_model, tmp_path):
    from safetensors import safe_open
    awq = write_awq_checkpoint(source_model, str(tmp_path / "awq"), group_size=32, modules_to_not_convert=["mlp.down_proj"])
    gptq = write_gptq_checkpoint(source_model, str(tmp_path / "gptq"), bits=4, group_size=32, desc_act=True)
    with open(f"{awq}/config.json") as f:
        assert json.load(f)["quantization_config"] == {
            "quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4, "version": "gemm",
            "modules_to_not_convert": ["mlp.down_proj"]}
    with safe_open(f"{awq}/model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.gate_proj.qweight").shape == (64, 128 // 8)
        assert f.get_tensor("model.layers.0.mlp.gate_proj.scales").dtype == torch.float16
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16
    assert "model.layers.0.mlp.down_proj.weight" in names and "model.layers.0.mlp.down_proj.qweight" not in names
    assert {"model.layers.1.self_attn.q_proj.qweight", "model.layers.1.self_attn.q_proj.qzeros",
            "model.layers.1.self_attn.q_proj.scales"} <= names
    with open(f"{gptq}/config.json") as f:
        config = json.load(f)["quantization_config"]
    assert (config["quant_method"], config["bits"], config["desc_act"], config["sym"], config["checkpoint_format"]) == \
        ("gptq", 4, True, True, "gptq")
    with safe_open(f"{gptq}/model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").shape == (128 // 8, 64)
        assert f.get_tensor("model.layers.0.mlp.down_proj.g_idx").shape == (128,)
        q, k = (f.get_tensor(f"model.layers.0.self_attn.{p}_proj.g_idx") for p in "qk")
        assert torch.equal(q, k) and not torch.equal(q, f.get_tensor("model.layers.1.self_attn.q_proj.g_idx"))
    plain = write_dequantized_checkpoint(gptq, str(tmp_path / "plain"))
    with open(f"{plain}/config.json") as f:
        assert "quantization_config" not in json.load(f)
    with safe_open(f"{plain}/model.safetensors", "pt") as f, safe_open(f"{source_model}/model.safetensors", "pt") as s:
        for name in s.keys():
            assert f.get_tensor(name).dtype == torch.float32
            original, stored = s.get_tensor(name), f.get_tensor(name)
            assert (stored - original).norm() <= 0.15 * original.norm()     # 4 bits: ~1/10 of the norm
