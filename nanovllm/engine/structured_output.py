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

import numpy as np
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
        self.tokenizer_info = info
        self.compiler = xgrammar.GrammarCompiler(info)
        self.utf8_guard = Utf8Guard(info.decoded_vocab, vocab_size)
        self.batch_matcher = xgrammar.BatchGrammarMatcher()
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self.compiled: OrderedDict[tuple, object] = OrderedDict()
        # cumulative, for stats(): host time spent filling masks, the steps and rows masked
        self.mask_seconds = 0.0
        self.num_masked_steps = self.num_masked_rows = 0

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
            schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
            return "json", lambda: compiler.compile_json_schema(_bounded_strings_as_patterns(schema),
                                                                any_whitespace=any_whitespace)
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
        self.utf8_guard.apply(bitmask, [seqs[row] for row in rows], rows)
        self.mask_seconds += time.perf_counter() - start
        self.num_masked_steps += 1
        self.num_masked_rows += len(rows)
        return bitmask, None if len(rows) == len(seqs) else rows


class Utf8Guard:
    """xgrammar (0.2.8) lets the lead bytes E0, ED, F0 and F4 be followed by any continuation byte,
    though each allows only part of them (others make overlong or surrogate sequences: invalid
    UTF-8, shown as U+FFFD). A byte-level vocabulary has such leads as tokens of their own; after
    one, the tokens that start with a continuation byte it does not allow are masked too."""
    SECOND_BYTE = {0xE0: range(0xA0, 0xC0), 0xED: range(0x80, 0xA0), 0xF0: range(0x90, 0xC0), 0xF4: range(0x80, 0x90)}

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int):
        self.lead_of = {token_id: token[-1] for token_id, token in enumerate(decoded_vocab)
                        if token and token[-1] in self.SECOND_BYTE}
        self.allowed_after: dict[int, torch.Tensor] = {}
        for lead, second in self.SECOND_BYTE.items():
            allowed = np.ones(-(-vocab_size // 32) * 32, dtype=bool)
            for token_id, token in enumerate(decoded_vocab):
                if token and 0x80 <= token[0] < 0xC0 and token[0] not in second:
                    allowed[token_id] = False
            # bit j of word i is token 32 i + j, as in xgrammar's bitmask
            self.allowed_after[lead] = torch.from_numpy(np.packbits(allowed, bitorder="little").view("<i4").copy())

    def apply(self, bitmask: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
        for seq, row in zip(seqs, rows):
            lead = self.lead_of.get(seq.token_ids[-1]) if len(seq.token_ids) > seq.num_prompt_tokens else None
            if lead is not None:
                bitmask[row] &= self.allowed_after[lead]


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# JSON string characters that need no escape. xgrammar (0.2.8) lets a string with minLength or
# maxLength hold raw control characters, which JSON forbids; the same bounds as a pattern do not.
PLAIN_STRING_CHARACTER = r'[^\x00-\x1f"\\]'


def _bounded_strings_as_patterns(schema):
    """The schema with each length-bounded string of no other form spelled as a pattern."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    if bounded and schema.get("type") == "string" and not {"pattern", "format", "enum", "const"} & schema.keys():
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f"^{PLAIN_STRING_CHARACTER}{{{low},{high}}}$"
    return schema
