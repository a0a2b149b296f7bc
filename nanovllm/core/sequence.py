"""One sequence of a request: its tokens, where it stands, and the KV blocks it holds.

A request usually has one sequence. With `n > 1` its prompt is prefilled once, short of the last
token, and then forked into n sequences that share the prompt's blocks; beam search forks a beam
each time two candidates continue it. Forked sequences share their group (the request's list).
"""
import copy
import time
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, request_id=None, priority: int = 0):
        self.seq_id = next(Sequence._ids)
        self.request_id = self.seq_id if request_id is None else request_id
        self.token_ids = list(token_ids)  # real ids only: prompt, then every collected token
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.priority = priority          # lower first, under scheduling_policy="priority"
        self.status = SequenceStatus.WAITING
        # Row of the sampled ids on the device (a step in flight's) that holds this sequence's next
        # token, which the host has not collected yet (the next step reads it there); None when none.
        self.pending_row: int | None = None
        self.num_computed_tokens = 0      # tokens whose K/V are in the cache
        self.num_cached_tokens = 0        # prompt tokens served by the prefix cache at first admission
        self.admitted = False
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block, grown as blocks fill
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # prompt_logprobs: entry i for prompt token i (None for the first), filled as prefill steps
        # are collected; shared by the request's forks (one prompt)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(token_ids) if sampling_params.prompt_logprobs is not None else None)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.index = 0                    # completion index within the request
        self.group: list[Sequence] = [self]   # the request's sequences, shared by all of them
        self.num_forks_due = sampling_params.n - 1   # siblings made once the prompt is in
        self.beam_search = None           # the request's beam search, for a beam
        self.cum_logprob = 0.0            # beam search: sum of the chosen tokens' logprobs
        self.beam_candidates: dict[int, float] | None = None   # beam search: next tokens' logprobs
        self.grammar = None               # its SequenceGrammar, under structured outputs
        self.pooling_params = None        # a pooling request's PoolingParams: it ends after its prefill
        self.embedding: list[float] | None = None   # a pooling request's, once its prefill is collected

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before the next token is sampled: one short of the prompt when the
        sequence forks, so that each fork computes the last prompt token and samples on its own."""
        return self.num_tokens - 1 if self.num_forks_due else self.num_tokens

    def fork(self, index: int) -> "Sequence":
        """A sibling with the same tokens and the same (shared) blocks; the block manager counts the
        extra references (BlockManager.fork)."""
        child = copy.copy(self)
        child.seq_id, child.index, child.num_forks_due = next(Sequence._ids), index, 0
        child.token_ids, child.block_table = list(self.token_ids), list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.grammar = None if self.grammar is None else self.grammar.fork()
        self.group.append(child)
        return child

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence holds, the pending one included: what scheduling and K/V sizing count."""
        return len(self.token_ids) + (self.pending_row is not None)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and has no token collected yet (so they may be incomplete):
        its prompt is computed in full, never taken from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.token_ids) == self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Add a sampled token (the pending one, if the step that sampled it marked one)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.pending_row = None
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
