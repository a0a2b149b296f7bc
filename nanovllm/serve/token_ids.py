"""`return_token_ids` (vLLM's field): a whole completions response then carries each choice's
`prompt_token_ids` and `token_ids`; a chat response carries `prompt_token_ids` at the top and each
choice's `token_ids`. RL trainers use them to score exactly the tokens the policy sampled."""
from nanovllm.serve.errors import APIError


def check_return_token_ids(request) -> None:
    if request.return_token_ids and request.stream:
        raise APIError(400, "return_token_ids is not available when stream=true", param="return_token_ids")


def add_token_ids(body: dict, finals: list[dict], chat: bool, drop_generated: bool = False) -> dict:
    """Put the ids in `body`, whose choices are the outputs of `finals` in order (prompt-major)."""
    outs = [(final, out) for final in finals for out in final["outputs"]]
    for choice, (final, out) in zip(body["choices"], outs, strict=True):
        choice["token_ids"] = [] if drop_generated else list(out["token_ids"])
        if not chat:
            choice["prompt_token_ids"] = list(final["prompt_token_ids"])
    if chat:
        body["prompt_token_ids"] = list(finals[0]["prompt_token_ids"])
    return body
