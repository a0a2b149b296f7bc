"""Load safetensors checkpoints (one file or many shards) through each parameter's weight_loader.

Checkpoint names are Hugging Face's; projections we keep merged (q/k/v, gate/up) take their
pieces by shard id, weights and biases alike. Experts stacked into one parameter take each
expert's tensor by (shard id, expert id). A tied LM head is the embedding, so a checkpoint's
copy of it is skipped; an untied one must be in the checkpoint like every other weight.
Checkpoints made for an FP8 KV cache carry each layer's `self_attn.k_scale` and `v_scale`; they are
handed back to the runner, which uses them when the cache is FP8. A pipeline stage reads only the
tensors of the layers it holds (`CausalLM.holds`).
"""
import glob
import os
import re
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.moe import expert_checkpoint_names


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    param.data.copy_(loaded[:])


def checkpoint_names(model: nn.Module) -> dict[str, tuple[str, tuple]]:
    """Every checkpoint tensor the model needs -> (our parameter, shard id or () or (shard id, expert id))."""
    packed = getattr(model, "packed_modules_mapping", {})
    names = {}
    for param_name, param in model.named_parameters():   # a tied LM head is listed once, as the embedding
        num_experts = getattr(param, "num_experts", None)
        if num_experts is not None:
            names.update({name: (param_name, shard) for name, shard in
                          expert_checkpoint_names(param_name, num_experts).items()})
            continue
        pieces = [(part, shard_id) for part, (merged, shard_id) in packed.items() if f".{merged}." in param_name]
        if not pieces:
            names[param_name] = (param_name, ())
        for part, shard_id in pieces:
            merged = packed[part][0]
            names[param_name.replace(f".{merged}.", f".{part}.")] = (param_name, (shard_id,))
    return names


KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.([kv])_scale$")


def load_model(model: nn.Module, config: Config) -> dict[int, dict[str, torch.Tensor]]:
    """Fill every parameter from the checkpoint at config.model, or with random values of the same
    scale (load_format "dummy": benchmarks of shapes whose weights would not fit on disk).
    Returns the checkpoint's K/V cache scales: layer index -> {"k": tensor, "v": tensor}."""
    if config.load_format == "dummy":
        from nanovllm.checkpoints.quantized_checkpoint import quantize_random_tensors
        from nanovllm.checkpoints.random_checkpoint import random_tensors
        param = next(model.parameters())
        tensors = random_tensors(config.hf_config, dtype=param.dtype, device=str(param.device))
        if config.model_config.quantization is not None:
            tensors = quantize_random_tensors(config.model_config.quantization, tensors)
    else:
        tensors = checkpoint_tensors(config.model)
    # every checkpoint tensor's whole shape, against which weight updates are checked (weight_update.py)
    model.checkpoint_shapes = {}
    kv_scales = load_tensors(model, tensors, config.model, model.checkpoint_shapes)
    process_weights_after_loading(model)
    return kv_scales


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each quantized layer's method repack, fold or quantize what it loaded (once)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model keeps (a tied LM head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_tensors(path: str) -> Iterator[tuple[str, object]]:
    """Each tensor is read lazily as a safetensors slice, so a rank reads only the part it keeps."""
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, object]], path: str,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    params = dict(model.named_parameters())
    wanted = checkpoint_names(model)
    loaded, kv_scales = set(), {}
    holds = getattr(model, "holds", lambda name: True)
    for name, tensor in tensors:
        if not holds(name):      # another pipeline stage's
            continue
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.tie_word_embeddings):
            continue
        if name.startswith("lm_head.") and model.lm_head is None:     # runner="pooling" keeps no LM head
            continue
        kv_scale = KV_SCALE_NAME.search(name)
        if kv_scale:
            layer, which = kv_scale.groups()
            kv_scales.setdefault(int(layer), {})[which] = tensor[...].float().reshape(-1)
            continue
        if name not in wanted and model.lm_head is None and f"model.{name}" in wanted:
            name = f"model.{name}"      # a bare decoder's checkpoint, as Qwen3-Embedding's: no "model." prefix
        if name not in wanted:
            raise ValueError(f"model: checkpoint tensor {name!r} has no place in the model")
        target, shard = wanted[name]
        if shapes is not None:
            shapes[name] = tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            loader(param, tensor, *shard)
        loaded.add(name)
    missing = sorted(set(wanted) - loaded)
    if missing:
        raise ValueError(f"model: checkpoint at {path!r} lacks {len(missing)} weight(s) the model needs: "
                         f"{missing[:5]}{' and more' if len(missing) > 5 else ''}")
    return kv_scales
