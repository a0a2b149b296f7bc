"""AWQ and GPTQ checkpoints written offline from a 16/32-bit one by round-to-nearest quantization,
laid out as AutoAWQ and GPTQModel publish them (tensor names, dtypes, packing, config.json), and
their dequantized float32 twin for transformers to run as the reference.

Round-to-nearest uses each format's own grid (no calibration data):
- AWQ (AutoAWQ awq/quantize/quantizer.py, pseudo_quantize_tensor with zero_point): per group of
  input rows and output column, s = (max - min).clamp(min=1e-5) / 15, z = clamp(-round(min / s),
  0, 15), q = clamp(round(w / s) + z, 0, 15).
- GPTQ sym (GPTQModel quantization/quantizer.py, find_params and quantize): the range includes 0,
  xmax = max(|min|, max), s = 2 * xmax / maxq (xmax / maxq when the group has no negative value),
  z = (maxq + 1) / 2, q = clamp(round(w / s) + z, 0, maxq). With desc_act the input rows are taken
  in the order of decreasing Hessian diagonal, and g_idx[row] = (position of the row in that
  order) // group_size (GPTQModel quantization/gptq.py). The Hessian comes from the layer's
  inputs, so projections of one input (q/k/v, gate/up) share the order; without calibration data
  the writer draws that order at random, seeded by the input (act_order).
Every tensor that is not quantized is stored in float16, as the published checkpoints are.
"""
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanovllm.quantization.int_packing import (AWQ_PACK_ORDER, dequantize_awq, dequantize_gptq, pack_columns,
                                               pack_rows)

# the linear layers inside decoder layers; embeddings, norms and the LM head stay 16-bit
QUANTIZABLE = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def quantize_awq(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """w [out, in] -> AWQ gemm's qweight, qzeros, scales."""
    w = weight.to(torch.float16).float()     # AutoAWQ quantizes the half-precision layer
    out_features, in_features = w.shape
    groups = w.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = (-torch.round(low / s)).clamp(0, 15)
    q = (torch.round(groups / s.unsqueeze(2)) + zeros.unsqueeze(2)).clamp(0, 15).reshape(out_features, in_features)
    return {"qweight": pack_columns(q.t().to(torch.int32), 4, AWQ_PACK_ORDER),
            "qzeros": pack_columns(zeros.t().to(torch.int32), 4, AWQ_PACK_ORDER),
            "scales": scales.t().contiguous()}


def act_order(name: str, in_features: int) -> torch.Tensor:
    """A stand-in for GPTQ's act order of the layer `name`: the same for layers that read one input."""
    shared_input = re.sub(r"\.(q|k|v)_proj\.", ".qkv_proj.", re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name))
    seed = int.from_bytes(hashlib.sha1(shared_input.encode()).digest()[:4], "little")
    return torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))


def quantize_gptq(weight: torch.Tensor, bits: int, group_size: int, order: torch.Tensor | None = None,
                  zeros_minus_one: bool = True) -> dict[str, torch.Tensor]:
    """w [out, in] -> GPTQ's qweight, qzeros, scales, g_idx (symmetric); order: the input rows in
    act order (desc_act), None for their plain order."""
    w = weight.to(torch.float16).float()
    out_features, in_features = w.shape
    group_size = in_features if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    device = w.device
    order = torch.arange(in_features, device=device) if order is None else order.to(device)
    g_idx = torch.empty(in_features, dtype=torch.int32, device=device)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32, device=device) // group_size
    num_groups = in_features // group_size
    scales = torch.empty(num_groups, out_features, dtype=torch.float16, device=device)
    for group in range(num_groups):
        rows = w[:, order[group * group_size:(group + 1) * group_size]]
        low, high = rows.amin(dim=1).clamp(max=0), rows.amax(dim=1).clamp(min=0)
        high = torch.maximum(low.abs(), high)
        low = torch.where(low < 0, -high, low)
        empty = (low == 0) & (high == 0)
        low, high = torch.where(empty, -1.0, low), torch.where(empty, 1.0, high)
        scales[group] = ((high - low) / maxq).to(torch.float16)
    zero = (maxq + 1) // 2
    s = scales.float()[g_idx.long()].t()                                  # [out, in]
    q = (torch.round(w / s) + zero).clamp(0, maxq).to(torch.int32)
    zeros = torch.full((num_groups, out_features), zero - int(zeros_minus_one), dtype=torch.int32, device=device)
    return {"qweight": pack_rows(q.t().contiguous(), bits), "qzeros": pack_columns(zeros, bits),
            "scales": scales, "g_idx": g_idx}


def write_awq_checkpoint(source: str, target: str, group_size: int = 128,
                         modules_to_not_convert: list[str] | None = None) -> str:
    """An AWQ (gemm, 4 bits, zero point) copy of the checkpoint at source; a layer whose name
    contains an entry of modules_to_not_convert stays float16 (AutoAWQ's substring match)."""
    config = {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4,
              "version": "gemm", "modules_to_not_convert": modules_to_not_convert}
    skip = modules_to_not_convert or []
    return _write(source, target, config,
                  lambda name, w: None if any(s in name for s in skip) else quantize_awq(w, group_size))


def write_gptq_checkpoint(source: str, target: str, bits: int = 4, group_size: int = 128, desc_act: bool = False,
                          checkpoint_format: str = "gptq") -> str:
    """A GPTQ copy (symmetric, GPTQModel's config keys) of the checkpoint at source. checkpoint_format
    "gptq" (v1, what GPTQModel saves by default) stores zeros - 1; "gptq_v2" stores them as they are."""
    config = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": True, "lm_head": False,
              "quant_method": "gptq", "checkpoint_format": checkpoint_format, "pack_dtype": "int32",
              "meta": {"quantizer": ["nanovllm"]}}
    minus_one = checkpoint_format == "gptq"
    return _write(source, target, config, lambda name, w: quantize_gptq(
        w, bits, group_size, act_order(name, w.shape[1]) if desc_act else None, minus_one))


def write_dequantized_checkpoint(source: str, target: str) -> str:
    """The float32 checkpoint a quantized one stands for: every packed linear layer dequantized
    with the torch reference, everything else widened from float16. transformers loads it."""
    config = _read_config(source)
    quant = config.pop("quantization_config")
    tensors = _read_tensors(source)
    out = {}
    for name, tensor in tensors.items():
        if not name.endswith(".qweight"):
            if name.rsplit(".", 1)[-1] not in ("qzeros", "scales", "g_idx"):
                out[name] = tensor.float()
            continue
        prefix = name[:-len(".qweight")]
        qzeros, scales = tensors[prefix + ".qzeros"], tensors[prefix + ".scales"]
        if quant["quant_method"] == "awq":
            weight = dequantize_awq(tensor, qzeros, scales, quant["group_size"])
        else:
            weight = dequantize_gptq(tensor, qzeros, scales, tensors[prefix + ".g_idx"], quant["bits"],
                                     quant.get("checkpoint_format", "gptq") != "gptq_v2")
        out[prefix + ".weight"] = weight
    _set_dtype(config, "float32")
    return _save(source, target, config, out)


def quantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]], quantize,
                      quantizable: re.Pattern = QUANTIZABLE) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a 16/32-bit checkpoint -> the quantized checkpoint's: each weight whose name
    matches `quantizable` (by default the layers' linear weights, experts aside) replaced by what
    quantize(name, weight) returns (None: kept), the rest as they are."""
    for name, tensor in tensors:
        packed = quantize(name, tensor) if quantizable.search(name) else None
        if packed is None:
            yield name, tensor
            continue
        prefix = name[:-len(".weight")]
        for key, value in packed.items():
            yield f"{prefix}.{key}", value.contiguous()


def _write(source: str, target: str, quantization_config: dict, quantize) -> str:
    config = _read_config(source)
    config["quantization_config"] = quantization_config
    _set_dtype(config, "float16")
    out = {name: tensor if tensor.dtype == torch.int32 or name.endswith((".scales", ".g_idx")) else
           tensor.to(torch.float16)
           for name, tensor in quantized_tensors(_read_tensors(source).items(), quantize)}
    return _save(source, target, config, out)


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _set_dtype(config: dict, dtype: str) -> None:
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _save(source: str, target: str, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    """config.json, one safetensors file, and every other file of source (tokenizer, generation config)."""
    os.makedirs(target, exist_ok=True)
    for file in os.listdir(source):
        if file != "config.json" and not file.startswith("model") and os.path.isfile(os.path.join(source, file)):
            shutil.copy(os.path.join(source, file), target)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    return target


def quantize_random_tensors(quantization, tensors):
    """(name, tensor) of random 16-bit weights (load_format "dummy") -> as a checkpoint of
    `quantization` (a QuantizationConfig) stores them; online FP8 takes them as they are."""
    skipped = lambda name: quantization.is_skipped(name.rsplit(".", 1)[0])  # noqa: E731
    if quantization.name == "awq":
        return quantized_tensors(tensors, lambda name, w: None if skipped(name) else quantize_awq(w, quantization.group_size))
    if quantization.name == "gptq":
        return quantized_tensors(tensors, lambda name, w: quantize_gptq(
            w, quantization.bits, quantization.group_size,
            act_order(name, w.shape[1]) if quantization.desc_act else None, quantization.zeros_minus_one))
    if quantization.name == "fp8" and quantization.serialized:
        if quantization.weight_block_size != (128, 128):
            raise ValueError("quantization: random fp8 weights are written in the [128, 128] block layout only")
        from nanovllm.checkpoints.fp8_checkpoint import LINEAR_WEIGHT, quantize
        return quantized_tensors(tensors, lambda name, w: None if skipped(name) else quantize(w, "fp8-block")[0],
                                 LINEAR_WEIGHT)     # experts' projections too
    return tensors
