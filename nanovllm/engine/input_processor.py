"""Requests in: prompts tokenized and checked, sampling parameters validated against this model, and
the Sequence a request starts as. Everything is checked before anything is queued, so a bad request
leaves the engine untouched.
"""
from collections.abc import Callable, Hashable

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.engine.chat_template import Message, apply_chat_template
from nanovllm.engine.grammars import StructuredOutputManager
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


def check_prompt_list(prompts) -> None:
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")


def pair_prompts_with_params(prompts: list[Prompt], sampling_params) -> list[tuple[Prompt, SamplingParams]]:
    """Each prompt with its SamplingParams (one for all, one per prompt, or the defaults)."""
    check_prompt_list(prompts)
    if not isinstance(sampling_params, (list, tuple)):
        sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
    return list(zip(prompts, sampling_params))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, config: Config, prompt: Prompt) -> list[int]:
    """Token ids of a prompt, or a ValueError/TypeError saying what is wrong with it."""
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt)
    else:
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError("prompt is empty")
    limit = config.max_model_len
    if len(token_ids) >= limit:
        raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len={limit} allows at most "
                         f"{limit - 1} so that at least one token can be generated")
    vocab_size = config.model_config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return token_ids


class InputProcessor:
    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase,
                 grammars: Callable[[], StructuredOutputManager]):
        self.config = config
        self.tokenizer = tokenizer
        self.grammars = grammars          # the grammar manager, made by the first constrained request

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return encode_prompt(self.tokenizer, self.config, prompt)

    def check_runner(self, params: SamplingParams | PoolingParams) -> None:
        """A generating engine takes SamplingParams, a pooling one PoolingParams; else a ValueError."""
        if self.config.runner == "pooling" and not isinstance(params, PoolingParams):
            raise ValueError("runner: this engine was started with runner='pooling', which computes embeddings "
                             "(LLM.embed, /v1/embeddings); start one with runner='generate' to generate text")
        if self.config.runner == "generate" and isinstance(params, PoolingParams):
            raise ValueError("runner: this engine was started with runner='generate'; start one with "
                             "runner='pooling' (nanovllm serve --runner pooling) to compute embeddings")

    def check_pooling_params(self, pooling_params) -> PoolingParams:
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        self.check_runner(pooling_params)
        pooling_params.validate(self.config.model_config.hidden_size)
        return pooling_params

    def check_sampling_params(self, sampling_params) -> SamplingParams:
        """Validate again (fields may have changed since construction), against this vocabulary."""
        if isinstance(sampling_params, PoolingParams):
            return self.check_pooling_params(sampling_params)
        self.check_runner(sampling_params)
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params.validate()
        vocab_size = self.config.model_config.vocab_size
        bad = [t for t in sampling_params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if sampling_params.structured_outputs is not None:    # compiled (and cached) before any work
            self.grammars().compile(sampling_params.structured_outputs)
        return sampling_params

    def new_sequence(self, token_ids: list[int], sampling_params: SamplingParams | PoolingParams,
                     request_id: Hashable | None = None, priority: int = 0) -> Sequence:
        """The first sequence of a checked request, with its grammar if it is constrained. A pooling
        request is a sequence that samples nothing and ends once its prefill is collected."""
        self.check_runner(sampling_params)
        if isinstance(sampling_params, PoolingParams):
            seq = Sequence(token_ids, SamplingParams(max_tokens=1), request_id, priority)
            seq.pooling_params = sampling_params
            return seq
        seq = Sequence(token_ids, sampling_params, request_id, priority)
        if sampling_params.structured_outputs is not None:
            seq.grammar = self.grammars().new_grammar(sampling_params.structured_outputs, sampling_params.ignore_eos)
        return seq

    def apply_chat_template(self, messages: list[Message], tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of one conversation under the tokenizer's chat template, ready for the reply."""
        return apply_chat_template(self.tokenizer, messages, self.config.model, tools, chat_template_kwargs)
