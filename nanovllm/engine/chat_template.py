"""A conversation as prompt token ids, under the tokenizer's chat template: shared by LLM.chat and
AsyncLLM, which needs only a tokenizer (its engine may run in another process)."""
from transformers import PreTrainedTokenizerBase

Message = dict          # {"role": str, "content": str}; an assistant's may carry tool_calls instead
# arguments of apply_chat_template that chat_template_kwargs may not replace
RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "tools", "tokenize", "return_dict", "return_tensors",
                                    "padding", "truncation", "max_length"})


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[Message], model: str,
                        tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                        add_special_tokens: bool = False) -> list[int]:
    """Token ids of one conversation under the tokenizer's chat template, ready for the reply. The
    template renders `tools` (OpenAI's function definitions) and reads `chat_template_kwargs` (such
    as Qwen3's enable_thinking). The template writes the special tokens it wants; add_special_tokens
    adds the tokenizer's own (e.g. a BOS) on top, as vLLM's /tokenize may be asked to."""
    if tokenizer.chat_template is None:
        raise ValueError(f"messages: the tokenizer of {model!r} has no chat template")
    if not isinstance(messages, (list, tuple)) or not messages or not all(map(_is_message, messages)):
        raise TypeError("messages must be a non-empty list of {'role': str, 'content': str} dicts "
                        "(an assistant message may carry 'tool_calls' instead of content)")
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
        raise TypeError(f"tools must be a list of dicts (function definitions), got {tools!r}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_ARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}")
    kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                         **kwargs)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _is_message(message) -> bool:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    content = message.get("content")
    return isinstance(content, str) or (content is None and bool(message.get("tool_calls")))
