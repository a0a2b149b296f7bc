"""Completions with `echo` and `prompt_logprobs` (what lm-evaluation-harness's loglikelihood
requests send: echo, logprobs=1, max_tokens=1 or 0), built from the engine's prompt logprobs.

With echo, each choice's text starts with the prompt's text, and with `logprobs` the prompt tokens
come first in `logprobs` (tokens, token_logprobs, top_logprobs, text_offset), the first token's
logprob and top_logprobs None, as OpenAI and vLLM return them. `max_tokens: 0` (only with echo) runs
the engine for one token and drops it, as vLLM does: the choice holds the prompt alone, with
finish_reason "length" and no completion tokens. `prompt_logprobs` gives each choice vLLM's
`prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}} with
the prompt token and the top k.
"""
from nanovllm.serve.protocol import CompletionRequest
from nanovllm.serve.responses import ResponseBuilder


def echo_response(builder: ResponseBuilder, request: CompletionRequest, prompts: list, finals: list[dict]) -> dict:
    """The whole completions response of an echo or prompt_logprobs request; `prompts` as the
    request gave them (a string's text is echoed as given), `finals` each prompt's engine output."""
    drop_generated = request.max_tokens == 0
    outs, echoed = [], []
    for prompt, final in zip(prompts, finals):
        for out in final["outputs"]:
            if drop_generated:
                out = {**out, "text": "", "token_ids": [], "logprobs": [], "finish_reason": "length"}
            outs.append({**out, "logprobs": None} if request.echo else out)
            echoed.append((prompt, final, out))
    body = builder.response(outs, sum(len(final["prompt_token_ids"]) for final in finals))
    for choice, (prompt, final, out) in zip(body["choices"], echoed):
        prompt_ids = final["prompt_token_ids"]
        if request.echo:
            prompt_text = prompt if isinstance(prompt, str) else builder.tokenizer.decode(prompt_ids)
            choice["text"] = prompt_text + choice["text"]
            if request.logprobs is not None:
                choice["logprobs"] = builder.logprobs(choice["index"], prompt_ids + out["token_ids"],
                                                      final["prompt_logprobs"] + (out["logprobs"] or []))
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(builder, prompt_ids, final["prompt_logprobs"],
                                                             request.prompt_logprobs)
    return body


def vllm_prompt_logprobs(builder: ResponseBuilder, prompt_ids: list[int], entries: list[dict | None],
                         k: int) -> list[dict | None]:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the top k. Ranks count the alternatives the engine returned: exact
    for the top k and a prompt token among them; a prompt token outside them gets k + 1 at least."""
    result = []
    for token_id, entry in zip(prompt_ids, entries):
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
        kept = {}
        for rank, (candidate, logprob) in enumerate(ranked, start=1):
            if rank <= k or candidate == token_id:
                kept[candidate] = {"logprob": logprob, "rank": rank,
                                   "decoded_token": builder.tokenizer.decode([candidate])}
        result.append({token_id: kept.pop(token_id), **kept})
    return result
