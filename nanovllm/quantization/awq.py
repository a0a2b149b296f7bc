"""AWQ checkpoints (`quant_method: "awq"`, `version: "gemm"`, 4 bits, zero point), as AutoAWQ
writes them and Qwen publishes Qwen3-*-AWQ: per linear layer `qweight` int32 [in, out/8] (8 output
columns per word in AWQ's interleaved order), `qzeros` int32 [in/g, out/8] packed the same way,
`scales` fp16 [in/g, out]; w = (q - z) * s. Layers named in `modules_to_not_convert` stay 16-bit.

AWQ packs output columns, so a column-parallel split cuts qweight and qzeros in whole words
(out/8 per word) and scales per column, and a row-parallel split cuts all three along the input
rows (scales and zeros by whole groups). After loading, the tensors are repacked for the integer
GEMM (nanovllm/kernels/int_gemm.py), whose words hold input rows.
"""
import torch
from torch import nn

from nanovllm.quantization.base import ModelShape, QuantizationConfig, UnquantizedLinearMethod, shard_param
from nanovllm.quantization.int_packing import awq_for_gemm
from nanovllm.quantization.weight_only import WeightOnlyIntMethod, check_groups

COLUMNS_PER_WORD = 8


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, skipped_modules: list[str] | tuple[str, ...] = ()):
        super().__init__(skipped_modules)
        self.group_size = group_size

    @classmethod
    def from_config(cls, quantization_config: dict) -> "AWQConfig":
        bits = quantization_config.get("bits", quantization_config.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization: awq checkpoints with bits={bits!r} are not supported; supported: [4]")
        version = str(quantization_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization: awq version {version!r} is not supported; supported: ['gemm']")
        if not quantization_config.get("zero_point", True):
            raise ValueError("quantization: awq without zero_point is not supported")
        group_size = quantization_config.get("group_size", quantization_config.get("q_group_size"))
        if not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"quantization: awq group_size must be a positive integer, got {group_size!r}")
        return cls(group_size, quantization_config.get("modules_to_not_convert") or ())

    @classmethod
    def random_weights_config(cls) -> dict:
        return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}

    def describe(self) -> str:
        return f"awq (4-bit, group {self.group_size})"

    def verify(self, model_config: ModelShape, tensor_parallel_size: int) -> None:
        check_groups("awq", model_config, tensor_parallel_size, self.group_size, COLUMNS_PER_WORD)

    def linear_method(self, layer: nn.Module, prefix: str):
        return UnquantizedLinearMethod() if self.is_skipped(prefix) else AWQLinearMethod(self.group_size)


class AWQLinearMethod(WeightOnlyIntMethod):
    def __init__(self, group_size: int):
        super().__init__(bits=4)
        self.group_size = group_size

    def create_weights(self, layer, input_size, output_sizes, dtype):
        out, g, words = sum(output_sizes), self.group_size, {1: COLUMNS_PER_WORD}
        layer.qweight = shard_param(torch.empty(input_size, out // COLUMNS_PER_WORD, dtype=torch.int32),
                                    output_dim=1, input_dim=0, units=words)
        layer.qzeros = shard_param(torch.empty(input_size // g, out // COLUMNS_PER_WORD, dtype=torch.int32),
                                   output_dim=1, input_dim=0, units={0: g, **words})
        layer.scales = shard_param(torch.empty(input_size // g, out, dtype=torch.float16),
                                   output_dim=1, input_dim=0, units={0: g})
        layer.params_dtype = dtype

    def gemm_layout(self, layer):
        packed = awq_for_gemm(layer.qweight.data, layer.qzeros.data, layer.scales.data, layer.params_dtype)
        return packed, self.group_size, None
