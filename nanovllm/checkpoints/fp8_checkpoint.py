"""FP8 checkpoints in the published layouts, written offline from a 16/32-bit checkpoint, and their
dequantized float32 twin (the same weights as the engine reads them) for transformers to judge by.

Layouts (where each detail was checked is stated in tests/test_quantization_fp8.py):
- "fp8-block": Qwen3-*-FP8 / DeepSeek-V3: `weight` float8_e4m3fn, `weight_scale_inv` float32
  [ceil(out/128), ceil(in/128)], quantization_config {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}; experts too, router not.
- "fp8-tensor-static": AutoFP8's per-tensor layout: scalar float32 `weight_scale` and `input_scale`
  (calibrated: max |input| / 448 over a few prompts), activation_scheme "static".
- "ct-channel-dynamic" / "ct-tensor-dynamic": compressed-tensors `*-FP8-dynamic`: `weight_scale`
  [out, 1] (or [1]) in the model's dtype, activations dynamic per token, format "float-quantized".
Every tensor that is not quantized is stored in bfloat16, as the published checkpoints do.
"""
import glob
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX

LAYOUTS = ("fp8-block", "fp8-tensor-static", "ct-channel-dynamic", "ct-tensor-dynamic")
LINEAR_WEIGHT = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
BLOCK = 128


def quantization_config(layout: str, ignore: list[str]) -> dict:
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK], **({"ignored_layers": ignore} if ignore else {})}
    if layout == "fp8-tensor-static":
        return {"quant_method": "fp8", "activation_scheme": "static", **({"ignored_layers": ignore} if ignore else {})}
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
              "actorder": None, "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**float8, "strategy": layout.split("-")[1], "dynamic": False, "observer": "minmax"},
            "input_activations": {**float8, "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None}},
        "ignore": ["lm_head", *ignore], "kv_cache_scheme": None}


def _is_ignored(module: str, ignore: list[str]) -> bool:
    return any(re.match(entry[3:], module) if entry.startswith("re:") else module == entry for entry in ignore)


def _to_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize(w: torch.Tensor, layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One weight [out, in] -> (its checkpoint tensors by suffix, the dequantized float32 weight)."""
    w = w.float()
    if layout == "fp8-block":
        n, k = w.shape
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = w.new_zeros(nb * BLOCK, kb * BLOCK)
        padded[:n, :k] = w
        scale = padded.abs().reshape(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3)) / FP8_MAX
        scale = scale.clamp_min(1e-12)
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        q = _to_fp8(w, full)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * full
    if layout == "ct-channel-dynamic":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12).to(torch.bfloat16)
        q = _to_fp8(w, scale.float())
        return {"weight": q, "weight_scale": scale}, q.float() * scale.float()
    scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12)
    q = _to_fp8(w, scale)
    stored = scale.reshape(1) if layout == "ct-tensor-dynamic" else scale.reshape(())
    return {"weight": q, "weight_scale": stored}, q.float() * scale


def calibrate_input_scales(path: str, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """max |input| / 448 of every linear projection over the prompts (float32 transformers model)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    absmax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            absmax[name] = torch.maximum(absmax.get(name, torch.tensor(0.0)), args[0].detach().abs().amax())
        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and LINEAR_WEIGHT.search(name + ".weight"):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    return {name: (value / FP8_MAX).float() for name, value in absmax.items()}


def write_fp8_checkpoint(src: str, dst: str, reference: str, layout: str, ignore: list[str] = (),
                         calibration_prompts: list[list[int]] = ()) -> None:
    """Write `src` quantized in `layout` to `dst`, and the float32 weights it dequantizes to to `reference`.
    Modules named in `ignore` (exact names or 're:' expressions) stay bfloat16 and are listed in the config."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ignore = list(ignore)
    tensors = {}
    for file in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors.update(load_file(file))
    input_scales = calibrate_input_scales(src, calibration_prompts) if layout == "fp8-tensor-static" else {}
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if LINEAR_WEIGHT.search(name) and not _is_ignored(module, ignore):
            parts, dequantized[name] = quantize(tensor, layout)
            quantized.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
            if layout == "fp8-tensor-static":
                quantized[f"{module}.input_scale"] = input_scales[module].reshape(())
        else:
            quantized[name] = tensor.to(torch.bfloat16)
            dequantized[name] = quantized[name].float()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for path, weights, extra in ((dst, quantized, {"quantization_config": quantization_config(layout, ignore)}),
                                 (reference, dequantized, {})):
        os.makedirs(path, exist_ok=True)
        for file in os.listdir(src):     # tokenizer and generation config
            if not file.endswith(".safetensors") and file not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(os.path.join(src, file), path)
        dtype = "bfloat16" if extra else "float32"
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config, "dtype": dtype, "torch_dtype": dtype, **extra}, f, indent=1)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
