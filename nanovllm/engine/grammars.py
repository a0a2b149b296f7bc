"""Structured outputs on the engine side: grammars compiled by xgrammar, one matcher per sequence,
and the token bitmask of each step.

The compiler is built once per engine from its tokenizer, on the first constrained request (an
engine that never sees one never imports xgrammar). Compiled grammars are cached by
StructuredOutputsParams.key(). A matcher lives on the host with its sequence and has accepted
exactly the sequence's collected tokens: it is advanced after each step (catch_up), and forks copy
it. A preempted or interrupted sequence keeps its collected tokens, so its matcher stays valid
without rollback; a lost step's pending tokens were never accepted.

A step's masks are written, only for its constrained rows and followed by those rows' ids, into one
of two host buffers used in turn (pinned on a GPU), so one copy takes them to the device, where one
kernel applies them (kernels/token_bitmask.py). A buffer is written again two steps later, after the
engine has collected the step in between, which the device ran after the copy out of it.
"""
import json
import logging
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)
GRAMMAR_CACHE_SIZE = 256          # compiled grammars kept (each holds the vocabulary's token masks)
MAX_FILL_THREADS = 8              # more threads cost more to start than the rows they would take
FILL_ROWS_PER_THREAD = 16         # a row takes some microseconds, a thread tens to start


class SequenceGrammar:
    """One sequence's matcher and how many of its completion tokens the matcher has accepted."""

    def __init__(self, matcher, ignore_eos: bool, stop_token_ids: frozenset[int]):
        self.matcher = matcher
        self.num_accepted = 0
        self.ignore_eos = ignore_eos
        self.stop_token_ids = stop_token_ids
        self.rejected = False            # a token the grammar did not allow (cannot happen under its mask)
        # Whether the next token is masked: once the grammar is complete and its stop token taken,
        # an ignore_eos sequence goes on unconstrained (as in vLLM). Kept here: asking the matcher
        # costs a call into xgrammar per sequence and step.
        self.constrains = True

    def fork(self) -> "SequenceGrammar":
        child = SequenceGrammar(self.matcher.fork(), self.ignore_eos, self.stop_token_ids)
        child.num_accepted, child.rejected, child.constrains = self.num_accepted, self.rejected, self.constrains
        return child

    def catch_up(self, seq: Sequence) -> None:
        """Accept the completion tokens collected since the last call."""
        start = seq.num_prompt_tokens + self.num_accepted
        if start == len(seq.token_ids):
            return
        for token_id in seq.token_ids[start:]:
            if not self.constrains:
                break
            if not self.matcher.accept_token(token_id):
                logger.warning("nanovllm: request %r: token %d is outside its grammar", seq.request_id, token_id)
                self.rejected = True
            # a matcher terminates on accepting a stop token, and only then (xgrammar's default)
            self.constrains = not self.rejected and token_id not in self.stop_token_ids
        self.num_accepted = len(seq.token_ids) - seq.num_prompt_tokens

    @property
    def finished(self) -> bool:
        """The grammar ended the output: its stop token was accepted (or the output broke it)."""
        return self.rejected or (not self.constrains and not self.ignore_eos)


@dataclass(slots=True)
class TokenBitmask:
    """One step's masks in a host buffer (pinned where the device is a GPU): the packed bitmask of
    the constrained rows, then the sampler row each applies to, so that one copy moves both."""
    buffer: torch.Tensor          # flat int32
    num_rows: int
    num_words: int

    @property
    def _rows_start(self) -> int:     # 16-byte aligned, as a tensor of its own would be (Triton specializes on it)
        return -(-self.num_rows * self.num_words // 4) * 4

    @property
    def bitmask(self) -> torch.Tensor:
        return self.buffer[:self.num_rows * self.num_words].view(self.num_rows, self.num_words)

    @property
    def rows(self) -> torch.Tensor:
        return self.buffer[self._rows_start:self._rows_start + self.num_rows]

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask, rows) on device, from one copy that does not wait for the device."""
        start = self._rows_start
        data = self.buffer[:start + self.num_rows].to(device, non_blocking=True)
        return data[:self.num_rows * self.num_words].view(self.num_rows, self.num_words), data[start:]


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
        self.stop_token_ids = frozenset(stop_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.utf8_guard = Utf8Guard(info.decoded_vocab, vocab_size)
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self.pin_memory = pin_memory
        self.compiled: OrderedDict[tuple, object] = OrderedDict()
        # xgrammar starts its fill threads anew on every call: a thread per FILL_ROWS_PER_THREAD rows,
        # up to half the cores this process may run on (the others run the rest of the host's work)
        self.max_fill_threads = max(1, min(MAX_FILL_THREADS, usable_cores() // 2))
        self.batch_matchers: dict[int, object] = {}
        self.buffers: list[torch.Tensor] = []     # two, used in turn (see the top of this file)
        self.num_steps_filled = 0
        # cumulative, for stats(): host time spent filling masks and accepting tokens, the steps and rows masked
        self.mask_seconds = self.accept_seconds = 0.0
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
        return SequenceGrammar(self.xgr.GrammarMatcher(self.compile(params)), ignore_eos, self.stop_token_ids)

    def accept(self, seqs: list[Sequence]) -> None:
        """Catch the matchers of seqs (each with a grammar) up with their collected tokens."""
        start = time.perf_counter()
        for seq in seqs:
            seq.grammar.catch_up(seq)
        self.accept_seconds += time.perf_counter() - start

    def token_bitmask(self, seqs: list[Sequence]) -> TokenBitmask | None:
        """The next token's bitmask for each of seqs (rows of the sampler's batch) whose grammar
        constrains it, after catching its matcher up with the collected tokens; None if none does."""
        start = time.perf_counter()
        matchers, rows, after_lead = [], [], []
        lead_of = self.utf8_guard.lead_of
        for row, seq in enumerate(seqs):
            grammar = seq.grammar
            if grammar is None or seq.is_finished:
                continue
            grammar.catch_up(seq)
            if grammar.constrains:
                if grammar.num_accepted and seq.token_ids[-1] in lead_of:
                    after_lead.append((len(rows), lead_of[seq.token_ids[-1]]))
                matchers.append(grammar.matcher)
                rows.append(row)
        if not rows:
            return None
        masks = TokenBitmask(self._next_buffer(len(rows)), len(rows), self.num_words)
        bitmask = masks.bitmask
        self._batch_matcher(len(rows)).batch_fill_next_token_bitmask(matchers, bitmask)
        for i, lead in after_lead:
            bitmask[i] &= self.utf8_guard.allowed_after[lead]
        masks.rows.numpy()[:] = rows
        self.mask_seconds += time.perf_counter() - start
        self.num_masked_steps += 1
        self.num_masked_rows += len(rows)
        return masks

    def _next_buffer(self, num_rows: int) -> torch.Tensor:
        """The buffer not used last time, large enough for num_rows rows (and their row ids)."""
        if not self.buffers or self.buffers[0].numel() < num_rows * (self.num_words + 1) + 4:
            # by powers of two: a batch grows a few rows at a time. A copy still queued out of the old
            # buffers keeps them from reuse (torch's pinned memory allocator waits for it).
            capacity = max(64, 1 << (num_rows - 1).bit_length())
            self.buffers = [torch.empty(capacity * (self.num_words + 1) + 4, dtype=torch.int32,
                                        pin_memory=self.pin_memory) for _ in range(2)]
        self.num_steps_filled += 1
        return self.buffers[self.num_steps_filled % 2]

    def _batch_matcher(self, num_rows: int):
        threads = min(self.max_fill_threads, -(-num_rows // FILL_ROWS_PER_THREAD))
        if threads not in self.batch_matchers:
            self.batch_matchers[threads] = self.xgr.BatchGrammarMatcher(threads)
        return self.batch_matchers[threads]


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


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
