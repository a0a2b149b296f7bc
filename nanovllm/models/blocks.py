"""The parts every dense decoder-only family is made of, named as in Hugging Face checkpoints.

The model: embedding, N decoder layers, final norm, LM head (its own weights or the embedding's).
Each decoder layer: RMSNorm -> attention (optional q/k RMSNorm per head, rotary and the KV-cache
store in one pass, grouped-query attention over the paged cache) -> residual -> RMSNorm -> SwiGLU
MLP -> residual. The residual adds are fused into the following norm. Where a projection is an FP8
layer that quantizes its input per token (and group), the norm or SiLU before it writes that input
in float8 directly (`fuse_input_quantization`): the layer skips its own quantization pass.

A family file subclasses `CausalLM` and states what its config.json means (see the class).

Under pipeline parallelism a model holds only its stage's layers (layers/parallel_state.py): the
others are empty placeholders, so checkpoint names keep their indices and `holds` tells the loader
which tensors to skip. The first stage holds the embedding, the last the final norm and the LM head
(and the embedding too when the head is tied to it); a stage before the last returns its hidden
states and residual, which the next stage's forward takes in place of the embedding.
"""
import re

import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.parallel_state import parallel_state, stage_layers
from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.models.model_config import ModelConfig
from nanovllm.quantization.base import QuantizationConfig


def fuse_input_quantization(producer: nn.Module, consumer: LinearBase) -> None:
    """Let `producer` (RMSNorm or SiluAndMul, whose output is the consumer's whole input) quantize
    its output the way the consumer's FP8 method would; nothing changes for other methods."""
    producer.quant_group_size = consumer.quant_method.fused_input_group_size(consumer)


def mlp_prefix(layer_index: int) -> str:
    """The checkpoint name of a layer's feed-forward block (quantization configs match on it)."""
    return f"model.layers.{layer_index}.mlp"


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, prefix: str):
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_heads, config.num_kv_heads,
                                          bias=config.qkv_bias, quant_config=config.quantization,
                                          prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_heads * head_dim, config.hidden_size, bias=config.o_bias,
                                        quant_config=config.quantization, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale=head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        qkv = qkv.view(qkv.shape[0], -1, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary_emb, self.q_norm, self.k_norm))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up kept as one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        fuse_input_quantization(self.act_fn, self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activation = self.gate_up_proj.silu_and_mul(x)     # fused where the layer's kernel can
        if activation is None:
            activation = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(activation)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, mlp: nn.Module, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = SelfAttention(config, rotary_emb, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = mlp
        fuse_input_quantization(self.input_layernorm, self.self_attn.qkv_proj)
        # o_proj's output goes only into the residual add of post_attention_layernorm; down_proj's
        # into the next layer's input_layernorm or the final norm
        self.self_attn.o_proj.feed_residual_norm()
        if isinstance(mlp, GatedMLP):       # a mixture of experts takes its input 16-bit
            fuse_input_quantization(self.post_attention_layernorm, mlp.gate_up_proj)
            mlp.down_proj.feed_residual_norm()

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no weights, never run."""


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, mlps: dict[int, nn.Module], has_embedding: bool = True,
                 has_norm: bool = True):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if has_embedding else None
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                     config.rope_scaling)
        self.layers = nn.ModuleList([DecoderLayer(config, rotary_emb, mlps[i], f"model.layers.{i}") if i in mlps
                                     else MissingLayer() for i in range(config.num_layers)])
        self.start_layer, self.end_layer = min(mlps), max(mlps) + 1
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if has_norm else None
        last = self.layers[self.end_layer - 1]
        if self.norm is None and isinstance(last.mlp, GatedMLP):    # its output is sent, not normed here
            last.mlp.down_proj.leaves_sums_to_norm = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The final hidden states; on a stage before the last, (hidden states, residual) for the next
        stage. `intermediate` is the previous stage's, where this is not the first."""
        if intermediate is None:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if self.norm is None:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class CausalLM(nn.Module):
    """A decoder model and its LM head. Subclasses (one per family, named by its architecture)
    set the class attributes below, which `ModelConfig.from_hf` reads."""
    qk_norm: bool = False              # RMSNorm on each query and key head
    qkv_bias: bool = False             # q/k/v biases always; otherwise config.json's attention_bias decides
    rope_types: tuple[str, ...] = ("default",)   # rope scaling types the family's checkpoints use
    # checkpoint name -> (our parameter, shard id) for the projections we keep merged
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        state = parallel_state()
        first, last = state.is_first_stage, state.is_last_stage
        start, end = stage_layers(config.num_layers, state.stage, state.num_stages)
        self.tie_word_embeddings = config.tie_word_embeddings
        self.model = DecoderModel(config, {i: self.build_mlp(config, i) for i in range(start, end)},
                                  has_embedding=first or (last and self.tie_word_embeddings), has_norm=last)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if last else None
        if self.tie_word_embeddings and last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        """The feed-forward block of one layer (a mixture of experts would return its own here)."""
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                        quant_config=config.quantization, prefix=mlp_prefix(layer_index))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, positions, intermediate)

    @property
    def start_layer(self) -> int:
        return self.model.start_layer

    def holds(self, checkpoint_name: str) -> bool:
        """Does this pipeline stage keep the checkpoint tensor? (The loader skips the others.)"""
        layer = LAYER_NAME.match(checkpoint_name)
        if layer:
            return self.model.start_layer <= int(layer[1]) < self.model.end_layer
        if checkpoint_name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if checkpoint_name.startswith("model.norm."):
            return self.model.norm is not None
        if checkpoint_name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def compute_logits(self, hidden_states: torch.Tensor, gather: bool = True) -> torch.Tensor | None:
        return self.lm_head(hidden_states, gather)
