"""Qwen3-MoE (Qwen3-30B-A3B and kin): Qwen3's attention, with a sparse mixture-of-experts block in
place of the dense MLP in every `decoder_sparse_step`-th layer, except those in `mlp_only_layers`.
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.moe import SparseMoeBlock
from nanovllm.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3MLP


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """The rule of Hugging Face's Qwen3MoeDecoderLayer."""
    return (layer_index not in config.mlp_only_layers and config.num_experts > 0
            and (layer_index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if is_sparse_layer(config, layer_index):
            self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                      config.moe_intermediate_size, config.norm_topk_prob)
        else:
            self.mlp = Qwen3MLP(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3MoeForCausalLM(nn.Module):
    # the dense layers' projections; the experts' come through nanovllm.layers.moe.expert_weight_target
    packed_modules_mapping = Qwen3ForCausalLM.packed_modules_mapping

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.model = Qwen3MoeModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
