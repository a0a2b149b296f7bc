"""A chat request's prompt: its messages and tools under the tokenizer's chat template, with the
request's chat_template_kwargs (e.g. {"enable_thinking": false})."""
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from nanovllm.serve.errors import APIError


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None,
                chat_template_kwargs: dict | None, model: str) -> list[int]:
    """Token ids of the conversation, ready for the reply; a 400 naming messages if the template
    cannot render it (or the tokenizer has none)."""
    if tokenizer.chat_template is None:
        raise APIError(400, f"the tokenizer of {model!r} has no chat template", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    except (TemplateError, ValueError, TypeError) as e:
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages")
    return tokenizer.encode(text, add_special_tokens=False)
