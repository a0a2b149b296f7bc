"""Qwen2 and Qwen2.5: biases on the query, key and value projections, no q/k norm."""
from nanovllm.models.blocks import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
