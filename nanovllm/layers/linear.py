"""Linear layers whose weights are split over tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes its slice, no communication);
row-parallel layers split the input features and sum the partial products with one all-reduce.
How the weights are stored and multiplied is the layer's `quant_method` (16-bit by default; the
checkpoint's format otherwise, see nanovllm/quantization/base.py), chosen by the model's
quantization config and the layer's checkpoint name (`prefix`). Every parameter carries a
`weight_loader` that copies this rank's slice out of a checkpoint tensor (or a lazily read
safetensors slice, so each rank reads only its own part), cut by `load_shard` along the axes the
method declared. An optional bias is split like the output features it belongs to.
"""
from typing import ClassVar

import torch
from torch import nn

from nanovllm.layers.all_reduce import tensor_parallel_all_reduce
from nanovllm.layers.parallel_state import parallel_state
from nanovllm.quantization.base import QuantizationConfig, UnquantizedLinearMethod, shard_param


def tp_rank_and_size() -> tuple[int, int]:
    """This rank's place in its tensor-parallel group (its pipeline stage's ranks)."""
    state = parallel_state()
    return state.tp_rank, state.tp_size


def tp_group():
    """The group a tensor-parallel collective runs in (None: the whole world)."""
    return parallel_state().tp_group


def load_shard(param: nn.Parameter, loaded, out: tuple[int, int, int] | None = None,
               inp: tuple[int, int] | None = None, shard_index: int = 0, expert_id: int | None = None) -> None:
    """Copy part of a checkpoint tensor into part of `param`, in features of the layer:
    out = (first output feature in the checkpoint tensor, first in param, count), inp = (first
    input feature in the checkpoint tensor, count); None keeps the whole axis. Axes, units and
    per-part scalars are the parameter's (see `shard_param`); a parameter stacked over experts
    declares them for one expert's slice, `expert_id`."""
    data = param.data if expert_id is None else param.data[expert_id]
    if param.per_shard:
        data[shard_index].copy_(loaded[...].reshape(()))
        return
    src_index, dst, repeats = [slice(None)] * data.dim(), data, {}
    for dim, cut in ((param.output_dim, out), (param.input_dim, inp and (inp[0], 0, inp[1]))):
        if dim is None:
            continue
        src_unit, unit = param.checkpoint_units.get(dim, 1), param.units.get(dim, 1)
        if cut is None:
            if src_unit == unit:
                continue
            cut = (0, 0, dst.shape[dim] * unit)     # whole, but repeated per feature
        src_start, dst_start, size = cut
        first, end = src_start // src_unit, -(-(src_start + size) // src_unit)
        src_index[dim] = slice(first, end)
        if src_unit == unit:
            dst = dst.narrow(dim, dst_start // unit, end - first)
        else:   # kept per feature: each checkpoint element repeated over the features it covers
            assert unit == 1, "a parameter's unit is 1 or the checkpoint's"
            dst = dst.narrow(dim, dst_start, size)
            repeats[dim] = torch.arange(src_start, src_start + size) // src_unit - first
    src = loaded[tuple(src_index)]
    for dim, index in repeats.items():
        src = src.index_select(dim, index.to(src.device))      # random weights are drawn on the device
    dst.copy_(src)


class LinearBase(nn.Module):
    """input_size and output_sizes are this rank's: one output size per logical part of the matrix;
    input_start is this rank's first input feature (row-parallel layers split the input)."""
    splits_input: ClassVar[bool] = False     # does tensor parallelism split the input features?

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", input_start: int = 0):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.tp_group = tp_group()
        self.input_size, self.output_sizes, self.input_start = input_size, output_sizes, input_start
        self.quant_method = quant_config.linear_method(self, prefix) if quant_config else UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_sizes, torch.get_default_dtype())
        if bias:
            self.bias = shard_param(torch.empty(sum(output_sizes)), output_dim=0)
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(input_size, [output_size // tp_rank_and_size()[1]], bias, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = self.output_sizes[0]
        load_shard(param, loaded, out=(self.tp_rank * size, 0, size))


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input kept as one matrix (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        tp = tp_rank_and_size()[1]
        super().__init__(input_size, [size // tp for size in output_sizes], bias, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        load_shard(param, loaded, out=(self.tp_rank * size, offset, size), shard_index=shard_id)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this [gate; up] layer where its method computes it in the same kernel
        (one-row float8 GEMVs); None otherwise."""
        return self.quant_method.apply_silu_and_mul(self, x, self.bias)


class QKVParallelLinear(LinearBase):
    """Query, key and value projections as one matrix, split by heads. With more ranks than KV
    heads, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        rank, tp = tp_rank_and_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.first_kv_head = rank * num_kv_heads // tp
        kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, [self.num_heads * head_dim, kv_size, kv_size], bias, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q_size, kv_size = self.output_sizes[0], self.output_sizes[1]
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.first_kv_head * self.head_dim
        load_shard(param, loaded, out=(start, offset, size), shard_index="qkv".index(shard_id))


class RowParallelLinear(LinearBase):
    """The bias is whole on every rank and added once, after the partial products are summed."""
    splits_input = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        rank, tp = tp_rank_and_size()
        super().__init__(input_size // tp, [output_size], bias, quant_config, prefix, input_start=rank * input_size // tp)
        self.leaves_sums_to_norm = False

    def feed_residual_norm(self) -> None:
        """Called by a decoder layer whose residual RMSNorm takes this layer's whole output. With one
        rank and no bias the output may then be unfinished split-K sums (PendingSums), which the
        norm's kernel finishes: the 4-bit GEMV's programs need not wait for each other."""
        self.leaves_sums_to_norm = self.tp_size == 1 and self.bias is None

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        load_shard(param, loaded, inp=(self.input_start, self.input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x)
        if self.tp_size > 1:
            y = tensor_parallel_all_reduce(y, self.tp_group)
        return y if self.bias is None else y + self.bias
