"""nanovllm: a small, readable offline LLM inference engine."""
from nanovllm.async_llm import AsyncLLM
from nanovllm.llm import LLM
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import BeamSearchParams, SamplingParams
from nanovllm.structured_outputs import StructuredOutputsParams

__all__ = ["AsyncLLM", "LLM", "SamplingParams", "PoolingParams", "BeamSearchParams", "StructuredOutputsParams"]
