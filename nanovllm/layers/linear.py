"""Linear layers whose weights are split over tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes its slice, no communication);
row-parallel layers split the input features and sum the partial products with one all-reduce.
Every weight carries a `weight_loader` that copies this rank's slice out of a checkpoint tensor
(or a lazily read safetensors slice, so each rank reads only its own part). An optional bias is
split like the output features it belongs to, with the same loader.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def tp_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size // tp_rank_and_size()[1], bias)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        size = param.shape[0]
        param.data.copy_(loaded[self.tp_rank * size:(self.tp_rank + 1) * size])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input kept as one matrix (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data[offset:offset + size].copy_(loaded[self.tp_rank * size:(self.tp_rank + 1) * size])


class QKVParallelLinear(LinearBase):
    """Query, key and value projections as one matrix, split by heads. With more ranks than KV
    heads, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        rank, tp = tp_rank_and_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.first_kv_head = rank * num_kv_heads // tp
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, self.first_kv_head * self.head_dim
        param.data[offset:offset + size].copy_(loaded[start:start + size])


class RowParallelLinear(LinearBase):
    """The bias is whole on every rank and added once, after the partial products are summed."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size // tp_rank_and_size()[1], output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        if param.dim() == 1:
            param.data.copy_(loaded[:])
            return
        size = param.shape[1]
        param.data.copy_(loaded[:, self.tp_rank * size:(self.tp_rank + 1) * size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias
