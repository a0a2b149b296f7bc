"""`quant_method: "compressed-tensors"` (llm-compressor's format), float 8-bit schemes: the
`*-FP8-dynamic` and `*-FP8` checkpoints.

config.json's quantization_config (the keys vLLM's compressed_tensors.py reads):
    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "float", "symmetric": true, "strategy": "channel" | "tensor",
                     "dynamic": false, ...},
         "input_activations": {"num_bits": 8, "type": "float", "symmetric": true,
                               "strategy": "token", "dynamic": true, ...}   (or "tensor", dynamic false)
     }},
     "ignore": ["lm_head", "re:.*mlp.gate$", ...]}
Tensors: `weight` float8_e4m3fn [out, in]; `weight_scale` [out, 1] (channel) or [1] (tensor) in the
model's dtype or float32; `input_scale` [1] for static activations. `ignore` entries stay 16-bit.
The layers are fp8.py's.
"""
from torch import nn

from nanovllm.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from nanovllm.quantization.fp8 import Fp8ChannelLinearMethod, Fp8TensorLinearMethod


def _float8_scheme(args: dict | None, what: str) -> dict:
    if not args or args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(f"quantization: compressed-tensors {what} must be 8-bit float (type 'float', num_bits 8); "
                         f"got {args!r}")
    if args.get("symmetric") is False:
        raise ValueError(f"quantization: compressed-tensors {what} must be symmetric")
    return args


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, weight_strategy: str, activation_strategy: str, skipped_modules=()):
        super().__init__(skipped_modules)
        self.weight_strategy = weight_strategy          # "channel" or "tensor"
        self.activation_strategy = activation_strategy  # "token" (dynamic) or "tensor" (static)

    @classmethod
    def from_config(cls, quantization_config: dict) -> "CompressedTensorsConfig":
        fmt = quantization_config.get("format")
        if fmt != "float-quantized":
            raise ValueError(f"quantization: compressed-tensors format {fmt!r} is not supported; "
                             f"supported: ['float-quantized']")
        groups = list((quantization_config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"quantization: compressed-tensors needs exactly one config group, got {len(groups)}")
        group = groups[0]
        if group.get("targets") != ["Linear"]:
            raise ValueError(f"quantization: compressed-tensors targets {group.get('targets')!r} are not supported; "
                             f"supported: ['Linear']")
        weights = _float8_scheme(group.get("weights"), "weights")
        if weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
            raise ValueError(f"quantization: compressed-tensors weight strategy {weights.get('strategy')!r} is not "
                             f"supported; supported: ['channel', 'tensor'] (static)")
        acts = _float8_scheme(group.get("input_activations"), "input_activations")
        strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
        if (strategy, dynamic) not in (("token", True), ("tensor", False)):
            raise ValueError(f"quantization: compressed-tensors input_activations strategy {strategy!r} with "
                             f"dynamic={dynamic} is not supported; supported: 'token' dynamic, 'tensor' static")
        return cls(weights["strategy"], strategy, quantization_config.get("ignore") or ())

    def describe(self) -> str:
        acts = "dynamic per-token" if self.activation_strategy == "token" else "static per-tensor"
        return f"compressed-tensors fp8 per-{self.weight_strategy} weights, {acts} activations"

    def linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        if self.weight_strategy == "channel":
            if self.activation_strategy != "token":
                raise ValueError("quantization: compressed-tensors per-channel weights need dynamic per-token activations")
            return Fp8ChannelLinearMethod()
        return Fp8TensorLinearMethod(static_input=self.activation_strategy == "tensor")
