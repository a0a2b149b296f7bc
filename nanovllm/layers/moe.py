"""A sparse mixture-of-experts feed-forward block: a router picks each token's top-k experts, whose
SwiGLU MLPs run as grouped GEMMs over weights stacked per expert.

Checkpoints store each expert apart (`experts.{e}.gate_proj/up_proj/down_proj.weight`);
`expert_checkpoint_names` tells the loader which of them make up a stacked parameter (those carry
`num_experts`), and the loader hands each to `FusedMoE.weight_loader` with its shard and expert id,
which copies it into the stacked w13 [E, 2 * I, H] (gate rows, then up rows) or w2 [E, H, I].
Quantized checkpoints store more tensors per expert (`weight_scale_inv`...): the quantization
config's MoE method creates their stacked parameters (`w13_<suffix>`, `w2_<suffix>`) and hands the
layer its experts' weights for the kernels (float8 block experts: dequantized per expert).

Tensor parallelism splits every expert's intermediate dimension over the ranks (gate/up rows, down
columns), so each rank computes a partial sum of every token's output and one all-reduce after the
down projection completes it. The router is small and replicated.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.fused_moe import fused_moe, fused_moe_ref
from nanovllm.kernels.moe_routing import route, route_ref
from nanovllm.layers.all_reduce import tensor_parallel_all_reduce
from nanovllm.layers.linear import load_shard, tp_group, tp_rank_and_size
from nanovllm.quantization.base import QuantizationConfig, shard_param

# one expert's projection in a checkpoint -> the stacked parameters (w13_weight, w13_weight_scale_inv...) it goes into
STACKED_PARAMS = {"gate_proj": "w13", "up_proj": "w13", "down_proj": "w2"}


def expert_checkpoint_names(param_name: str, num_experts: int) -> dict[str, tuple[str, int]]:
    """The per-expert checkpoint tensors a stacked parameter is made of -> (shard id, expert id)."""
    prefix, stacked = param_name.rsplit(".", 1)
    target, suffix = stacked.split("_", 1)      # w13_weight_scale_inv -> w13, weight_scale_inv
    projs = [proj for proj, name in STACKED_PARAMS.items() if name == target]
    return {f"{prefix}.{e}.{proj}.{suffix}": (proj.removesuffix("_proj"), e) for e in range(num_experts) for proj in projs}


class Router(nn.Module):
    """The gate: one logit per expert. Replicated on every rank (each rank routes every token)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class UnquantizedMoEMethod:
    """16/32-bit stacked experts; the interface of a quantization config's `moe_method`."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_per_rank: int,
                       dtype: torch.dtype) -> None:
        layer.w13_weight = shard_param(torch.empty(num_experts, 2 * intermediate_per_rank, hidden_size, dtype=dtype),
                                       output_dim=0, input_dim=1)
        layer.w2_weight = shard_param(torch.empty(num_experts, hidden_size, intermediate_per_rank, dtype=dtype),
                                      output_dim=0, input_dim=1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def expert_weights(self, layer: nn.Module, dtype: torch.dtype):
        """(w13, w2) indexable by expert, as the fused MoE kernels and their twin take them."""
        return layer.w13_weight, layer.w2_weight


class FusedMoE(nn.Module):
    """Every expert's SwiGLU MLP, weights stacked by expert, this rank's slice of the intermediate size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.tp_group = tp_group()
        if intermediate_size % self.tp_size:
            raise ValueError(f"tensor_parallel_size={self.tp_size} must divide moe_intermediate_size={intermediate_size}")
        self.num_experts = num_experts
        self.intermediate_per_rank = intermediate_size // self.tp_size
        method = quant_config.moe_method(self, prefix) if quant_config else None
        self.quant_method = method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, num_experts, hidden_size, self.intermediate_per_rank,
                                         torch.get_default_dtype())
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
            param.num_experts = num_experts     # marks a stacked parameter for the loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str, expert_id: int) -> None:
        """Copy this rank's slice of one expert's gate, up ([I, H]) or down ([H, I]) tensor."""
        size = self.intermediate_per_rank
        start = self.tp_rank * size
        if shard_id == "down":
            load_shard(param, loaded, inp=(start, size), expert_id=expert_id)
        else:
            offset = 0 if shard_id == "gate" else size
            load_shard(param, loaded, out=(start, offset, size), expert_id=expert_id)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of each token's weighted expert outputs (not yet all-reduced)."""
        w13, w2 = self.quant_method.expert_weights(self, x.dtype)
        if not x.is_cuda:
            return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
        return fused_moe(x, w13, w2, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router, then the top-k experts of every token; one all-reduce over the ranks."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool, quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Router(hidden_size, num_experts)     # stays 16-bit
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, quant_config, f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        # weights rounded to the activations' dtype before use, like the reference implementation
        weights, ids = (route if x.is_cuda else route_ref)(logits, self.top_k, self.norm_topk_prob, x.dtype)
        y = self.experts(x, weights, ids)
        if self.experts.tp_size > 1:
            y = tensor_parallel_all_reduce(y, self.experts.tp_group)
        return y
