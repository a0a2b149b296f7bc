"""Mistral: the Llama layout with plain rotary. Its sliding window is not implemented: the engine
refuses a window shorter than max_model_len (a longer one never takes effect)."""
from nanovllm.models.blocks import CausalLM


class MistralForCausalLM(CausalLM):
    pass
