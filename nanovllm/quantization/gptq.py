"""GPTQ checkpoints (`quant_method: "gptq"`, 4 or 8 bits, group size or -1, `desc_act` with
`g_idx`), as AutoGPTQ and GPTQModel write them: per linear layer `qweight` int32 [in*bits/32, out]
(32/bits consecutive input rows per word), `qzeros` int32 [groups, out*bits/32] (output columns per
word; checkpoint_format "gptq", the default, stores zeros - 1, "gptq_v2" the zeros), `scales` fp16
[groups, out] and `g_idx` int32 [in], the group of each input row; w = (q - z) * s.

GPTQ packs input rows, so a row-parallel split cuts qweight in whole words and g_idx with the
rows, and a column-parallel split cuts every tensor along the output columns (qzeros in whole
words). Scales and zeros follow the input rows only when groups are runs of rows: with act order
(`desc_act`) a rank's rows belong to any group, so every rank keeps all groups. After loading, a
layer whose rows form runs of groups drops g_idx; an act-order layer keeps it and the GEMM reads
each row's scale through it.
"""
import torch
from torch import nn

from nanovllm.quantization.base import ModelShape, QuantizationConfig, shard_param
from nanovllm.quantization.int_packing import gptq_for_gemm
from nanovllm.quantization.weight_only import WeightOnlyIntMethod, check_groups, linear_shapes

SUPPORTED_BITS = (4, 8)
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, zeros_minus_one: bool):
        super().__init__()
        self.bits, self.group_size, self.desc_act, self.zeros_minus_one = bits, group_size, desc_act, zeros_minus_one

    @classmethod
    def from_config(cls, quantization_config: dict) -> "GPTQConfig":
        bits = quantization_config.get("bits")
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"quantization: gptq checkpoints with bits={bits!r} are not supported; "
                             f"supported: {list(SUPPORTED_BITS)}")
        group_size = quantization_config.get("group_size", -1)
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise ValueError(f"quantization: gptq group_size must be a positive integer or -1, got {group_size!r}")
        checkpoint_format = quantization_config.get("checkpoint_format") or "gptq"
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization: gptq checkpoint_format {checkpoint_format!r} is not supported; "
                             f"supported: {list(CHECKPOINT_FORMATS)}")
        if quantization_config.get("dynamic"):
            raise ValueError("quantization: gptq per-module overrides ('dynamic') are not supported")
        if quantization_config.get("lm_head"):
            raise ValueError("quantization: gptq checkpoints with a quantized LM head are not supported")
        return cls(bits, group_size, bool(quantization_config.get("desc_act", False)), checkpoint_format == "gptq")

    @classmethod
    def random_weights_config(cls) -> dict:
        return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"gptq ({self.bits}-bit, {group}{', act order' if self.desc_act else ''})"

    def verify(self, model_config: ModelShape, tensor_parallel_size: int) -> None:
        per_word = 32 // self.bits
        check_groups("gptq", model_config, tensor_parallel_size, self.group_size, per_word)
        for name, (inputs, _) in linear_shapes(model_config, tensor_parallel_size).items():
            if inputs % per_word:
                raise ValueError(f"quantization: gptq packs {per_word} input rows per int32, which does not "
                                 f"divide the {inputs} input features of {name}")

    def linear_method(self, layer: nn.Module, prefix: str):
        return GPTQLinearMethod(self)


class GPTQLinearMethod(WeightOnlyIntMethod):
    def __init__(self, config: GPTQConfig):
        super().__init__(config.bits)
        self.config = config

    def create_weights(self, layer, input_size, output_sizes, dtype):
        out, per_word, g = sum(output_sizes), 32 // self.bits, self.config.group_size
        layer.qweight = shard_param(torch.empty(input_size // per_word, out, dtype=torch.int32),
                                    output_dim=1, input_dim=0, units={0: per_word})
        layer.g_idx = shard_param(torch.empty(input_size, dtype=torch.int32), input_dim=0)
        row_parallel = layer.splits_input and layer.tp_size > 1
        if g == -1:                                  # one group: every rank keeps it
            groups, split = 1, {}
        elif self.config.desc_act and row_parallel:
            groups, split = input_size * layer.tp_size // g, {}
        else:
            groups, split = input_size // g, dict(input_dim=0, units={0: g})
        # g_idx counts groups of the whole layer; this rank keeps its scales from this group on
        layer.first_group = layer.tp_rank * groups if split and row_parallel else 0
        words = {1: per_word}
        layer.qzeros = shard_param(torch.empty(groups, out // per_word, dtype=torch.int32), output_dim=1,
                                   input_dim=split.get("input_dim"), units={**split.get("units", {}), **words})
        layer.scales = shard_param(torch.empty(groups, out, dtype=torch.float16), output_dim=1, **split)
        layer.params_dtype = dtype

    def gemm_layout(self, layer):
        c = self.config
        rows, groups = layer.g_idx.numel(), layer.scales.shape[0]
        g_idx = layer.g_idx.data.long() - layer.first_group
        run = max(1, rows // groups)
        runs = torch.equal(g_idx, torch.arange(rows, device=g_idx.device) // run)   # groups are runs of rows
        packed = gptq_for_gemm(layer.qweight.data, layer.qzeros.data, layer.scales.data, self.bits,
                               c.zeros_minus_one, layer.params_dtype, act_order=not runs)
        return (packed, run, None) if runs else (packed, c.group_size, g_idx)
