"""From an API request to the engine's SamplingParams, one per completion choice."""
from dataclasses import replace

from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.protocol import SamplingFields


def sampling_params(request: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """SamplingParams of one choice; a bad value raises ValueError/TypeError naming the field."""
    return SamplingParams(
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
        stop=request.stop, stop_token_ids=request.stop_token_ids, logprobs=logprobs)


def params_per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The engine requests that make up the n choices of one prompt.

    The engine takes one completion per request for now, so n choices are n requests; with a seed,
    choice i uses seed + i so that the choices differ and stay reproducible. When the engine
    supports SamplingParams.n, this becomes `[replace(params, n=n)]` and the server is unchanged
    apart from reading each output's `outputs` list.
    """
    if n == 1:
        return [params]
    return [replace(params, seed=None if params.seed is None else params.seed + i) for i in range(n)]
