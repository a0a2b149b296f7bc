"""A conversation as prompt token ids, under the tokenizer's chat template: shared by LLM.chat and
AsyncLLM, which needs only a tokenizer (its engine may run in another process)."""
from transformers import PreTrainedTokenizerBase

Message = dict[str, str]


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[Message], model: str) -> list[int]:
    """Token ids of one conversation under the tokenizer's chat template, ready for the reply."""
    if tokenizer.chat_template is None:
        raise ValueError(f"messages: the tokenizer of {model!r} has no chat template")
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise TypeError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
