"""The MoE block against transformers' own Qwen3-MoE block, with the weights taken apart per expert
the way checkpoints store them and stacked again by our loader."""
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from torch import nn

from nanovllm.kernels.moe_routing import route, route_ref
from nanovllm.layers.moe import SparseMoeBlock, expert_checkpoint_names
from nanovllm.worker.weight_loader import checkpoint_names

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"     # the route kernel's; the CPU runs Triton's interpreter


def hf_block(norm_topk_prob: bool, num_experts: int = 8, top_k: int = 2) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=12, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 * 3)
    return block


def per_expert_checkpoint(block: Qwen3MoeSparseMoeBlock) -> dict[str, torch.Tensor]:
    """Checkpoint names and tensors of one layer's block, as published checkpoints have them."""
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    size = down.shape[-1]
    tensors = {"mlp.gate.weight": block.gate.weight.detach()}
    for e in range(gate_up.shape[0]):
        tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :size]
        tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, size:]
        tensors[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    return tensors


def block_in_a_model(block: SparseMoeBlock) -> nn.Module:
    """The block under the name `mlp`, as a decoder layer holds it."""
    holder = nn.Module()
    holder.mlp = block
    return holder


def load_block(block: SparseMoeBlock, tensors: dict[str, torch.Tensor]) -> None:
    """Through the loader's own map of checkpoint names to parameters and shards."""
    holder = block_in_a_model(block)
    params, wanted = dict(holder.named_parameters()), checkpoint_names(holder)
    assert set(wanted) == set(tensors)
    for name, tensor in tensors.items():
        target, shard = wanted[name]
        param = params[target]
        getattr(param, "weight_loader", lambda p, t: p.data.copy_(t))(param, tensor, *shard)


def test_expert_names_map_to_stacked_params():
    names = expert_checkpoint_names("model.layers.3.mlp.experts.w13_weight", 2)
    assert names == {f"model.layers.3.mlp.experts.{e}.{p}_proj.weight": (p, e) for e in (0, 1) for p in ("gate", "up")}
    names = expert_checkpoint_names("model.layers.3.mlp.experts.w2_weight", 3)
    assert names == {f"model.layers.3.mlp.experts.{e}.down_proj.weight": ("down", e) for e in range(3)}
    wanted = checkpoint_names(block_in_a_model(SparseMoeBlock(32, 4, 2, 12, True)))
    assert wanted["mlp.gate.weight"] == ("mlp.gate.weight", ())                      # the router, whole
    assert wanted["mlp.experts.3.up_proj.weight"] == ("mlp.experts.w13_weight", ("up", 3))
    assert wanted["mlp.experts.0.down_proj.weight"] == ("mlp.experts.w2_weight", ("down", 0))
    assert len(wanted) == 1 + 4 * 3


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("routing", [route_ref, route], ids=["twin", "kernel"])
def test_route_matches_transformers_router(norm_topk_prob, routing):
    """The twin and the kernel (Triton's interpreter on the CPU) against transformers' router."""
    block = hf_block(norm_topk_prob)
    x = torch.randn(50, 32)
    _, hf_weights, hf_ids = block.gate(x)
    device = DEVICE if routing is route else "cpu"
    weights, ids = (t.cpu() for t in routing((x @ block.gate.weight.T).to(device), 2, norm_topk_prob, torch.float32))
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(50)) if norm_topk_prob else (sums < 1).all()


@pytest.mark.parametrize("num_tokens,num_experts,top_k,dtype", [(1, 128, 8, torch.float16), (37, 60, 4, torch.float32),
                                                                 (5, 8, 8, torch.float16)])
def test_route_kernel_matches_twin(num_tokens, num_experts, top_k, dtype):
    """Qwen3-30B-A3B's 128 experts, a count that is no power of two, top-k of all: the same experts
    in the same order, weights within the dtype's rounding."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(DEVICE, dtype)
    for norm in (True, False):
        weights, ids = route(logits, top_k, norm, dtype)
        ref_weights, ref_ids = route_ref(logits, top_k, norm, dtype)
        assert torch.equal(ids, ref_ids) and weights.dtype == dtype
        torch.testing.assert_close(weights, ref_weights, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("norm_topk_prob,top_k", [(True, 2), (False, 2), (True, 1), (False, 8)])
def test_sparse_moe_block_matches_transformers(norm_topk_prob, top_k):
    torch.manual_seed(top_k)
    hf = hf_block(norm_topk_prob, top_k=top_k)
    ours = SparseMoeBlock(32, 8, top_k, 12, norm_topk_prob)
    load_block(ours, per_expert_checkpoint(hf))
    x = torch.randn(40, 32)
    _, _, ids = hf.gate(x)
    assert len(ids.unique()) >= min(8, 4 * top_k)          # routing spreads over several experts
    with torch.no_grad():
        expected = hf(x[None])[0]
        torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
        assert expected.abs().mean() > 0.1


def test_block_rejects_bad_top_k():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(32, 8, 9, 12, True)
