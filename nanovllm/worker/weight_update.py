"""Weights updated in place while the engine runs (RL rollouts: docs/rollout.md).

New tensors are copied (`copy_`) into the storage the model already has, through the same name map
and per-parameter weight loaders as start-up (q/k/v and gate/up merged, tensor-parallel shards
cut), so the CUDA graphs that captured those addresses stay valid. Online FP8 layers
(quantization="fp8" on a 16-bit checkpoint) keep no 16-bit weight: their parts are loaded into a
16-bit staging copy (started from the current weight dequantized, so a partial update keeps the
rest) and quantized once at the end into the existing float8 weight and scale.

Every name and shape is checked (`problems`) before anything is written: the caller loads only
when no rank found a problem.
"""
from collections.abc import Iterable

import torch
from torch import nn

from nanovllm.layers.moe import UnquantizedMoEMethod
from nanovllm.quantization.base import UnquantizedLinearMethod, shard_param
from nanovllm.quantization.fp8 import (Fp8BlockLinearMethod, Fp8BlockMoEMethod, Fp8ChannelLinearMethod,
                                       Fp8OnlineLinearMethod, quantize_weight_per_row)
from nanovllm.worker.weight_loader import KV_SCALE_NAME, checkpoint_names, default_weight_loader

# formats whose parameters hold exactly what the loader wrote (no repacking after loading)
IN_PLACE_METHODS = (UnquantizedLinearMethod, UnquantizedMoEMethod, Fp8BlockLinearMethod, Fp8ChannelLinearMethod,
                    Fp8BlockMoEMethod)


def skipped_name(model: nn.Module, name: str) -> bool:
    """Names the start-up loader skips too: rotary tables, a tied LM head, K/V cache scales."""
    return (name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.tie_word_embeddings)
            or KV_SCALE_NAME.search(name) is not None)


class PinnedStaging:
    """Host tensors to the GPU through two pinned buffers in turn: the host copies one tensor into a
    buffer while the link carries the one before. From pageable memory a plain copy runs at about
    7.5 GB/s (2.0-2.4 s for the Qwen3-8B shape's 15.3 GiB on an H200, docs/benchmarks.md)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def __call__(self, tensor):
        if (self.device.type != "cuda" or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu"
                or tensor.is_pinned()):
            return tensor
        turn, self.turn = self.turn, 1 - self.turn
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()       # the link is done with this buffer's last tensor
        if self.buffers[turn] is None or self.buffers[turn].numel() < tensor.nbytes:
            self.buffers[turn] = torch.empty(tensor.nbytes, dtype=torch.uint8, pin_memory=True)
        staged = self.buffers[turn][:tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        on_device = staged.to(self.device, non_blocking=True)
        self.copied[turn] = torch.cuda.Event()
        self.copied[turn].record()
        return on_device


class InPlaceWeightLoader:
    """One update of one rank's model: `problems` first, then `load` each tensor, then `finish`."""

    def __init__(self, model: nn.Module, checkpoint_shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 to_device: PinnedStaging):
        self.model = model
        self.dtype = dtype          # the model's 16/32-bit dtype: online FP8 stages in it, as start-up loads
        self.checkpoint_shapes = checkpoint_shapes      # as the start-up checkpoint had them
        self.wanted = checkpoint_names(model)
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.staged: dict[str, torch.Tensor] = {}       # online-FP8 parameter -> its 16-bit staging copy
        self.to_device = to_device      # the worker's, kept between updates (pinning is what costs)

    def _module(self, param_name: str) -> tuple[nn.Module, str]:
        module_name, _, attr = param_name.rpartition(".")
        return self.modules[module_name], attr

    def problems(self, metadata: Iterable[tuple[str, tuple[int, ...]]]) -> list[str]:
        """What is wrong with an update of these (name, full checkpoint shape) pairs; [] if nothing."""
        found = []
        for name, shape in metadata:
            if skipped_name(self.model, name):
                continue
            if name not in self.wanted:
                found.append(f"weights: tensor {name!r} has no place in the model")
                continue
            expected = self.checkpoint_shapes.get(name)
            if expected is not None and tuple(shape) != tuple(expected):
                found.append(f"weights: tensor {name!r} has shape {list(shape)}; the model's is {list(expected)}")
                continue
            module, _ = self._module(self.wanted[name][0])
            method = getattr(module, "quant_method", None)
            if method is not None and not isinstance(method, IN_PLACE_METHODS + (Fp8OnlineLinearMethod,)):
                found.append(f"weights: tensor {name!r} is stored as {type(method).__name__}, "
                             f"which cannot be updated in place")
        return found

    @torch.no_grad()
    def load(self, name: str, tensor) -> None:
        if skipped_name(self.model, name):
            return
        target, shard = self.wanted[name]
        tensor = self.to_device(tensor)
        param = self.params[target]
        module, attr = self._module(target)
        if isinstance(getattr(module, "quant_method", None), Fp8OnlineLinearMethod) and attr == "weight":
            param = self._staging(target, module)
            module.weight_loader(param, tensor, *shard)
            return
        getattr(param, "weight_loader", default_weight_loader)(param, tensor, *shard)

    def _staging(self, target: str, module: nn.Module) -> nn.Parameter:
        if target not in self.staged:
            current = module.weight.data.float() * module.weight_scale.data     # this rank's rows, dequantized
            self.staged[target] = shard_param(current.to(self.dtype), output_dim=0, input_dim=1)
        return self.staged[target]

    @torch.no_grad()
    def finish(self) -> None:
        """Quantize every staged online-FP8 weight into the float8 tensors the model already has."""
        for target, staged in self.staged.items():
            module, _ = self._module(target)
            weight, scale = quantize_weight_per_row(staged.data)
            module.weight.data.copy_(weight)
            module.weight_scale.data.copy_(scale)
        self.staged.clear()


def tensor_shape(tensor) -> tuple[int, ...]:
    """A tensor's or a lazily read safetensors slice's shape."""
    return tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)
