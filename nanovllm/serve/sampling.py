"""From an API request to the engine's SamplingParams."""
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.protocol import SamplingFields
from nanovllm.structured_outputs import StructuredOutputsParams


def sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None,
                    structured_outputs: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams of one prompt's request, with its n completions; a bad value raises
    ValueError/TypeError naming the field."""
    return SamplingParams(
        n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
        stop=request.stop, stop_token_ids=request.stop_token_ids, logprobs=logprobs,
        structured_outputs=structured_outputs, prompt_logprobs=prompt_logprobs)
