"""Qwen3: RMSNorm on each query and key head before rotary; biases only where attention_bias asks."""
from nanovllm.models.blocks import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
