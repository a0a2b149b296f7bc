"""Load safetensors checkpoints (one file or many shards) through each parameter's weight_loader."""
import glob
import os
from collections import Counter

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.moe import expert_checkpoint_names, expert_weight_target


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    param.data.copy_(loaded[:])


def load_model(model: nn.Module, path: str) -> None:
    """Each tensor is read lazily as a safetensors slice, so a rank reads only the part it keeps."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    loads = Counter()
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.tie_word_embeddings):
                    continue
                target, shard = name, ()
                expert = expert_weight_target(name)     # one expert's projection: stacked by expert
                if expert is not None:
                    target, shard = expert[0], expert[1:]
                for part, (merged, shard_id) in packed.items():
                    if expert is None and f".{part}." in name:
                        target, shard = name.replace(part, merged), (shard_id,)
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"model: checkpoint tensor {name!r} has no place in the model")
                loader = getattr(param, "weight_loader", default_weight_loader)
                with torch.no_grad():
                    loader(param, f.get_slice(name), *shard)
                loads[target] += 1
    expected = {name: len(expert_checkpoint_names(name, param.num_experts)) if hasattr(param, "num_experts") else 1
                for name, param in params.items()}
    for name in params:
        for part, (merged, _) in packed.items():
            if f".{merged}." in name:
                expected[name] = sum(1 for m, _ in packed.values() if m == merged)
    missing = sorted(name for name in params if loads[name] < expected[name])
    if missing:
        raise ValueError(f"model: checkpoint at {path!r} lacks weights for {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''}")
