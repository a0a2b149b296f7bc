"""Which model class runs a checkpoint, chosen by `architectures[0]` of its config.json.

The one-way order: model_config (facts read from config.json) <- blocks (shared layers) <- each
family <- this registry, which is the only place that knows every family.
"""
from transformers import PretrainedConfig

from nanovllm.models.blocks import CausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mistral import MistralForCausalLM
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    family.__name__: family
    for family in (Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM)
}
# the family of the bundled demo model and of the default tiny test models
REFERENCE_ARCHITECTURE = "Qwen3ForCausalLM"


def model_class(architecture: str) -> type[CausalLM]:
    """The CausalLM subclass for `architecture`; ValueError naming it and the supported ones."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model: architecture {architecture!r} is not supported; "
                         f"supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[architecture]


def read_model_config(hf_config: PretrainedConfig) -> ModelConfig:
    """The ModelConfig of a checkpoint's config.json; ValueError for what the engine cannot run."""
    architectures = getattr(hf_config, "architectures", None)
    if not architectures:
        raise ValueError("model: config.json has no 'architectures' entry naming the model class")
    return ModelConfig.from_hf(hf_config, model_class(architectures[0]))


def build_model(config: ModelConfig) -> CausalLM:
    """The model of `config`, on the current default device and dtype, weights not loaded."""
    return model_class(config.architecture)(config)
