"""Which model class runs a checkpoint, chosen by `architectures[0]` of its config.json.

A family's module is imported only when a checkpoint asks for it.
"""
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanovllm.models.blocks import CausalLM
    from nanovllm.models.model_config import ModelConfig

# architecture -> module that defines a class of that name
ARCHITECTURES = {
    "Qwen3ForCausalLM": "nanovllm.models.qwen3",
    "Qwen3MoeForCausalLM": "nanovllm.models.qwen3_moe",
    "Qwen2ForCausalLM": "nanovllm.models.qwen2",
    "LlamaForCausalLM": "nanovllm.models.llama",
    "MistralForCausalLM": "nanovllm.models.mistral",
}
# the family of the bundled demo model and of the default tiny test models
REFERENCE_ARCHITECTURE = "Qwen3ForCausalLM"


def model_class(architecture: str) -> "type[CausalLM]":
    """The CausalLM subclass for `architecture`; ValueError naming it and the supported ones."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model: architecture {architecture!r} is not supported; "
                         f"supported: {sorted(ARCHITECTURES)}")
    return getattr(importlib.import_module(ARCHITECTURES[architecture]), architecture)


def build_model(config: "ModelConfig") -> "CausalLM":
    """The model of `config`, on the current default device and dtype, weights not loaded."""
    return model_class(config.architecture)(config)
