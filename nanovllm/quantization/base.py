"""The seam between a linear layer and the format its weights are stored in.

A linear layer (nanovllm/layers/linear.py) is about parallelism only: which slice of the output
and input features this rank keeps. How those features are stored and multiplied is its
`quant_method`, a `LinearMethod` chosen once at construction by the checkpoint's
`QuantizationConfig` (or `UnquantizedLinearMethod` when there is none or the layer is skipped):

1. `create_weights(layer, input_size, output_sizes, dtype)` registers the parameters the format
   stores on `layer` (this rank's part; `input_size` and `output_sizes` are per rank, one output
   size per logical part: [q, k, v], [gate, up] or one). Each parameter is made by `shard_param`,
   which records how its axes follow the layer's features, so the layer's weight loader can cut
   any format's tensors for tensor parallelism with one function (`load_shard`):
   - `output_dim` / `input_dim`: the axis that runs along the output / input features (None: the
     tensor is not split along them and every rank keeps it whole);
   - `checkpoint_units` / `units`: {axis: features per element} in the checkpoint and in the
     parameter (1 for a weight; 128 for a block scale's input axis; 8 for AWQ's packed columns; the
     group size for a group scale). When the checkpoint's unit is larger than the parameter's (1),
     each element is repeated over the features it covers (block scales kept per output row);
   - `per_shard`: one scalar per logical part (per-tensor scales of q, k and v); the parameter has
     len(output_sizes) elements and each checkpoint scalar goes to its part's index.
2. `process_weights_after_loading(layer)` runs once after every tensor is in: repack, transpose,
   fold scales, or quantize a 16-bit weight (online quantization).
3. `apply(layer, x, bias)` multiplies: x [tokens, input_size] -> [tokens, sum(output_sizes)] in
   x's dtype, plus the bias when given. Row-parallel layers all-reduce after it; the bias is added
   by the layer after the reduce, so `apply` gets bias=None there.
4. `fused_input_group_size(layer)`: formats that quantize the input to float8 per token (and group)
   give the group size, and `apply` then also takes the input already quantized (a
   QuantizedActivation, from the RMSNorm or SiLU-and-mul before the layer); None: the input stays 16-bit.

A `QuantizationConfig` is read from config.json's `quantization_config` (`from_config`), states
which layers stay 16-bit (`is_skipped`: an ignore list of module names, dotted suffixes or
`re:` regular expressions) and hands out each layer's method (`linear_method`) and, where the
format has one, the method for stacked MoE experts (`moe_method`). `verify` checks the model's
shapes against the format before any weight is read. Formats register themselves by their
`quant_method` in nanovllm/quantization/__init__.py.

Embeddings, the LM head, norms and MoE routers are not linear layers here and stay 16-bit.
"""
import re
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ModelShape(Protocol):
    """The shape fields of a model's config that a format's `verify` reads (models/model_config.py's
    ModelConfig has them; quantization does not import it, models import quantization)."""
    num_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int | None
    num_experts: int | None

# our merged modules -> the checkpoint modules they are made of (ignore lists name the latter)
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def shard_param(data: torch.Tensor, output_dim: int | None = None, input_dim: int | None = None,
                checkpoint_units: dict[int, int] | None = None, units: dict[int, int] | None = None,
                per_shard: bool = False) -> nn.Parameter:
    """A parameter whose axes the layer's weight loader knows how to shard (see the module doc)."""
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    param.units = units or {}
    param.checkpoint_units = checkpoint_units or dict(param.units)
    param.per_shard = per_shard
    return param


class LinearMethod:
    """How one linear layer stores and multiplies its weights (see the module doc)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def fused_input_group_size(self, layer: nn.Module) -> int | None:
        return None

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """silu(gate) * up of a merged [gate; up] layer computed by its own kernel, or None where the
        method has no such kernel for x (the caller then runs apply and silu_and_mul)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """A 16-bit (or 32-bit) weight [out, in], multiplied by torch."""

    def create_weights(self, layer, input_size, output_sizes, dtype):
        layer.weight = shard_param(torch.empty(sum(output_sizes), input_size, dtype=dtype), output_dim=0, input_dim=1)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


class QuantizationConfig:
    """One checkpoint's quantization: which layers it covers and the method of each (see the module doc)."""
    name: ClassVar[str]          # the quant_method of config.json, the registry key

    def __init__(self, skipped_modules: list[str] | tuple[str, ...] = ()):
        self.skipped_modules = tuple(skipped_modules)

    def __eq__(self, other) -> bool:
        """The same format with the same settings (two reads of one config.json are equal)."""
        return type(self) is type(other) and vars(self) == vars(other)

    __hash__ = None     # settings may be lists: not a key

    @classmethod
    def from_config(cls, quantization_config: dict) -> "QuantizationConfig":
        """Read config.json's quantization_config; ValueError naming `quantization` for what we cannot run."""
        raise NotImplementedError

    @classmethod
    def online(cls) -> "QuantizationConfig":
        """The config that quantizes a 16-bit checkpoint while loading (formats in ONLINE_METHODS)."""
        raise NotImplementedError

    @classmethod
    def random_weights_config(cls) -> dict | None:
        """The quantization_config random weights (load_format "dummy") of a 16-bit shape take
        when `quantization` names this checkpoint format; None: the method quantizes online."""
        return None

    def describe(self) -> str:
        """A few words for the start-up line, e.g. 'fp8 (block 128x128)'."""
        return self.name

    def verify(self, model_config: ModelShape, tensor_parallel_size: int) -> None:
        """Check the model's shapes against the format; ValueError naming `quantization`."""

    def is_skipped(self, prefix: str) -> bool:
        """Whether the module at `prefix` (our name; merged modules stand for their parts) stays 16-bit.
        A merged module's parts must agree: half a qkv_proj cannot be quantized."""
        head, _, last = prefix.rpartition(".")
        parts = [f"{head}.{part}" if head else part for part in PACKED_MODULES.get(last, (last,))]
        skipped = [any(module_matches(part, entry) for entry in self.skipped_modules) for part in parts]
        if any(skipped) and not all(skipped):
            raise ValueError(f"quantization: the ignore list leaves only some of {parts} unquantized; "
                             f"they are computed as one matrix, so all or none must be listed")
        return all(skipped)

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        """The method of the linear layer at `prefix`: the format's, or unquantized when skipped."""
        raise NotImplementedError

    def moe_method(self, layer: nn.Module, prefix: str):
        """The method of stacked experts (nanovllm/layers/moe.py), or None: the experts stay 16-bit."""
        return None


def module_matches(name: str, entry: str) -> bool:
    """An ignore-list entry names a module exactly, by a dotted part of its name ('lm_head',
    'mlp.down_proj', 'model.layers.0'), or by a regular expression after 're:' (compressed-tensors)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return f".{entry}." in f".{name}."
