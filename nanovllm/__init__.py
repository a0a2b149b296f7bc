"""nanovllm: a small, readable offline LLM inference engine."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams"]
