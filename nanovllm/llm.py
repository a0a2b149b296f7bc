"""The user-facing entry point: `LLM(path, **engine_args).generate(prompts, sampling_params)`."""
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """An offline engine over one local Hugging Face checkpoint of a supported family (see README)."""
