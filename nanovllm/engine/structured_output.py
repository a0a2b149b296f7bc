"""Structured outputs on the engine side: grammars compiled by xgrammar, one matcher per sequence,
and the token bitmask of each step.

The compiler is built once per engine from its tokenizer, on the first constrained request (an
engine that never sees one never imports xgrammar). Compiled grammars are cached by
StructuredOutputsParams.key(). A matcher lives on the host with its sequence and has accepted
exactly the sequence's collected tokens: it is advanced after each step (catch_up), and forks copy
it. A preempted or interrupted sequence keeps its collected tokens, so its matcher stays valid
without rollback; a lost step's pending tokens were never accepted.
"""
import json
import logging
import re
import time
from collections import OrderedDict

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)
GRAMMAR_CACHE_SIZE = 256          # compiled grammars kept (each holds the vocabulary's token masks)


class SequenceGrammar:
    """One sequence's matcher and how many of its completion tokens the matcher has accepted."""

    def __init__(self, matcher, ignore_eos: bool):
        self.matcher = matcher
        self.num_accepted = 0
        self.ignore_eos = ignore_eos
        self.rejected = False            # a token the grammar did not allow (cannot happen under its mask)

    def fork(self) -> "SequenceGrammar":
        child = SequenceGrammar(self.matcher.fork(), self.ignore_eos)
        child.num_accepted, child.rejected = self.num_accepted, self.rejected
        return child

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked: once the grammar is complete and its stop token taken,
        an ignore_eos sequence goes on unconstrained (as in vLLM)."""
        return not (self.rejected or self.matcher.is_terminated())

    def catch_up(self, seq: Sequence) -> None:
        """Accept the completion tokens collected since the last call."""
        start = seq.num_prompt_tokens + self.num_accepted
        for token_id in seq.token_ids[start:]:
            if not self.constrains:
                break
            if not self.matcher.accept_token(token_id):
                logger.warning("nanovllm: request %r: token %d is outside its grammar", seq.request_id, token_id)
                self.rejected = True
        self.num_accepted = len(seq.token_ids) - seq.num_prompt_tokens

    @property
    def finished(self) -> bool:
        """The grammar ended the output: its stop token was accepted (or the output broke it)."""
        return self.rejected or (self.matcher.is_terminated() and not self.ignore_eos)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], pin_memory: bool):
        try:
            import xgrammar
        except ImportError:
            raise ImportError("structured_outputs needs the xgrammar package: pip install 'nanovllm[structured]'") \
                from None
        self.xgr = xgrammar
        # the model's vocabulary may be larger than the tokenizer's (padding rows): those ids are never allowed
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch_matcher = xgrammar.BatchGrammarMatcher()
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self.compiled: OrderedDict[tuple, object] = OrderedDict()
        # cumulative, for stats(): host time spent filling masks, and rows masked
        self.mask_seconds = 0.0
        self.num_masked_rows = 0

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params (cached), or a ValueError naming the field that fails."""
        key = params.key()
        compiled = self.compiled.get(key)
        if compiled is not None:
            self.compiled.move_to_end(key)
            return compiled
        field, compile_ = self._compile_call(params)
        try:
            compiled = compile_()
        except Exception as e:      # xgrammar says what is wrong, behind a C++ source location
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e)).strip()
            raise ValueError(f"structured_outputs.{field} cannot be compiled: {message}") from None
        self.compiled[key] = compiled
        if len(self.compiled) > GRAMMAR_CACHE_SIZE:
            self.compiled.popitem(last=False)
        return compiled

    def _compile_call(self, params: StructuredOutputsParams):
        compiler, any_whitespace = self.compiler, not params.disable_any_whitespace
        if params.json is not None:
            return "json", lambda: compiler.compile_json_schema(params.json, any_whitespace=any_whitespace)
        if params.json_object:        # any object: not strict, or only {} would match
            return "json_object", lambda: compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
        if params.regex is not None:
            return "regex", lambda: compiler.compile_regex(params.regex)
        if params.choice is not None:
            # JSON string escapes are EBNF string literals' escapes
            ebnf = "root ::= " + " | ".join(_ebnf_literal(choice) for choice in params.choice)
            return "choice", lambda: compiler.compile_grammar(ebnf)
        return "grammar", lambda: compiler.compile_grammar(params.grammar)

    def new_grammar(self, params: StructuredOutputsParams, ignore_eos: bool) -> SequenceGrammar:
        return SequenceGrammar(self.xgr.GrammarMatcher(self.compile(params)), ignore_eos)

    def token_bitmask(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int] | None] | None:
        """The next token's bitmask for each of seqs (rows of the sampler's batch) whose grammar
        constrains it, after catching its matcher up with the collected tokens: (bitmask [rows,
        ceil(vocab / 32)] int32 on the host, the constrained rows or None for all), or None."""
        start = time.perf_counter()
        matchers, rows = [], []
        for row, seq in enumerate(seqs):
            grammar = seq.grammar
            if grammar is None or seq.is_finished:
                continue
            grammar.catch_up(seq)
            if grammar.constrains:
                matchers.append(grammar.matcher)
                rows.append(row)
        if not rows:
            return None
        bitmask = torch.full((len(seqs), -(-self.vocab_size // 32)), -1, dtype=torch.int32,
                             pin_memory=self.pin_memory)
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        self.mask_seconds += time.perf_counter() - start
        self.num_masked_rows += len(rows)
        return bitmask, None if len(rows) == len(seqs) else rows


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
