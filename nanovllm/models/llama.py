"""Llama 3, 3.1 and 3.2: plain decoder layers; 3.1 and 3.2 stretch rotary with the `llama3` rule
(the small 3.2 models also tie the LM head to the embedding, which config.json says)."""
from nanovllm.models.blocks import CausalLM


class LlamaForCausalLM(CausalLM):
    rope_types = ("default", "llama3")
