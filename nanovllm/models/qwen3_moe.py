"""Qwen3-MoE (Qwen3-30B-A3B and kin): Qwen3's attention, with a sparse mixture-of-experts block in
place of the dense MLP in every `decoder_sparse_step`-th layer, except those in `mlp_only_layers`.

Checkpoints store each expert apart; the loader stacks them (see nanovllm.layers.moe).
"""
from torch import nn

from nanovllm.layers.moe import SparseMoeBlock
from nanovllm.models.blocks import CausalLM, mlp_prefix
from nanovllm.models.model_config import ModelConfig


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    """The rule of Hugging Face's Qwen3MoeDecoderLayer."""
    return (layer_index not in config.mlp_only_layers and bool(config.num_experts)
            and (layer_index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(CausalLM):
    qk_norm = True

    def build_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return super().build_mlp(config, layer_index)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, config.norm_topk_prob, config.quantization,
                              mlp_prefix(layer_index))
