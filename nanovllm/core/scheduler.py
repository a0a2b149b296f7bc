"""Continuous batching: which sequences compute how many tokens in the next step.

Prefill comes first: a step continues a prompt that is being chunked, then admits waiting
requests in arrival order while the token and sequence budgets and the KV pool allow. With no
prefill work, every running sequence decodes one token; when the pool runs dry the most recently
admitted sequence is preempted (its blocks freed, its tokens recomputed later). Under
scheduling_policy="priority", "arrival order" and "most recently admitted" read "by (priority,
arrival)": waiting requests are admitted lowest value first, and running stays in that order, so
that preemption takes the largest priority value (the latest arrival among equals).

A step is recorded in two halves, because the engine schedules the next step before this one's
tokens are back: advance (what the step computes, with a pending token per sampled sequence), then
fill (the tokens, and the stops they cause). When a step is lost (an exception or Ctrl-C in the
engine loop), `reset` takes every sequence back to the queue as a preemption would: pending tokens
are dropped and everything is recomputed, so no state of the lost step survives.

With speculative decoding, a decode step may verify proposed tokens: the engine core asks its
proposer for up to `draft_lengths` tokens per sequence and hands them back (add_drafts); a
sequence with k proposals computes k + 1 positions, for which blocks are reserved before the step;
once the step's tokens are back, the accepted proposals count as computed and blocks beyond the
sequence's end go back to the pool (fill_verified). Proposals need every token on the host, so the
engine collects each step before scheduling the next while the batch is small enough to speculate.
The scheduler itself launches nothing.

Under pipeline parallelism (P stages) the engine keeps P batches in flight, one per stage, while it
schedules the next. `schedule(busy)` leaves out the sequences the next step may not take: those of
the batches in flight, but for the oldest, which is collected right after the launch and whose
tokens the next step reads on the device. So P batches take turns, and a decode batch takes at
most a Pth of the running sequences.
"""
from bisect import insort
from collections import deque
from collections.abc import Callable, Set

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.core.step import SPECULATION_MAX_RUNNING, ScheduledBatch

def priority_key(seq: Sequence) -> tuple[int, float]:
    return seq.priority, seq.arrival_time


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager, num_speculative_tokens: int = 0):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order (by priority_key under "priority")
        self.by_priority = config.scheduling_policy == "priority"
        self.num_preemptions = 0
        # cumulative counters, for metrics
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0    # prompt tokens looked up / found
        self.num_speculative_tokens = num_speculative_tokens      # speculative decoding: k, or 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.prefix_cache_host_hits = 0                            # of those found, in the host tier
        # pipeline stages: the decode batches that take turns with the running sequences, one per stage
        self.num_decode_batches = config.pipeline_parallel_size

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self, busy: Set[Sequence] = frozenset()) -> ScheduledBatch:
        """The next step; `busy`: sequences of the batches in flight under pipeline stages, left out."""
        batch = self._schedule_prefill(busy)
        if not batch.seqs:
            batch = self._schedule_decode(busy)
        if not batch.seqs and self.running and all(seq.num_uncomputed_tokens > 1 and seq not in busy
                                                   for seq in self.running):
            # prompts in the middle of chunking, each waiting for blocks the others hold (batches in
            # flight let new prompts in beside a chunked one), and no step to free any: the newest
            # gives its blocks back
            self._preempt(self.running.pop())
            return self.schedule(busy)
        if batch.seqs:     # the host tier's copies go with the next step that launches
            batch.kv_offloads, batch.kv_loads = self.block_manager.take_block_transfers()
        return batch

    def _schedule_prefill(self, busy: Set[Sequence]) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch([], [], is_prefill=True)
        budget = self.max_num_batched_tokens
        for seq in self.running:                       # a prompt in the middle of chunking
            remaining = seq.prefill_target - seq.num_computed_tokens
            if seq.num_uncomputed_tokens > 1 and remaining > 0 and budget > 0 and seq not in busy:
                n = min(remaining, budget)
                if bm.can_allocate(seq, seq.num_computed_tokens + n):
                    bm.allocate(seq, seq.num_computed_tokens + n)
                    batch.seqs.append(seq)
                    batch.num_new_tokens.append(n)
                    budget -= n
        for seq in sorted(self.waiting, key=priority_key) if self.by_priority else list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.beam_candidates is not None or seq in busy:
                continue                               # a beam parked until its siblings have proposed,
                                                       # or preempted while its last token is in flight
            # prompt logprobs need the logits of every prompt position: recompute, as vLLM does
            cached_prefix = [] if seq.needs_prompt_logprobs else bm.find_cached_prefix(seq)
            num_cached = len(cached_prefix) * bm.block_size
            n = seq.prefill_target - num_cached
            if n > budget:
                if n <= self.max_num_batched_tokens:
                    break                              # fits whole in a later step
                n = budget                             # could never fit whole: chunk it
            while not bm.can_allocate(seq, num_cached + n, cached_prefix) and self._preempt_idle() >= 0:
                pass
            if not bm.can_allocate(seq, num_cached + n, cached_prefix):
                break
            bm.allocate(seq, num_cached + n, cached_prefix)
            seq.num_computed_tokens = num_cached
            if not seq.admitted:
                seq.admitted, seq.num_cached_tokens = True, num_cached
                self.num_prompt_tokens += seq.num_prompt_tokens
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += num_cached
                self.prefix_cache_host_hits += bm.num_host_hits(cached_prefix) * bm.block_size
            seq.status = SequenceStatus.RUNNING
            self.waiting.remove(seq)
            if self.by_priority:
                insort(self.running, seq, key=priority_key)
            else:
                self.running.append(seq)
            if n == 0:                                 # all it had to prefill was cached
                self._fork(seq)
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def fork(self, seq: Sequence) -> Sequence:
        """A new sibling of seq (a beam continued twice), queued where seq is."""
        child = seq.fork(len(seq.group))
        if seq.status == SequenceStatus.RUNNING:
            self.block_manager.fork(seq)
            # beside seq: siblings read the same prompt blocks, so running them side by side in a
            # decode step lets all but the first find those blocks in the GPU's L2 cache
            self.running.insert(self.running.index(seq) + 1, child)    # by identity: no Sequence.__eq__
        else:                                          # preempted: both recompute from scratch
            self.waiting.append(child)
        return child

    def _fork(self, seq: Sequence) -> None:
        """seq has computed its prompt but the last token: make its n - 1 siblings, sharing blocks."""
        for _ in range(seq.num_forks_due):
            self.fork(seq)
        seq.num_forks_due = 0

    def _schedule_decode(self, busy: Set[Sequence]) -> ScheduledBatch:
        bm = self.block_manager
        batch = ScheduledBatch([], [], is_prefill=False)
        limit = min(self.max_num_seqs, -(-len(self.running) // self.num_decode_batches))
        i = 0
        while i < len(self.running) and len(batch.seqs) < limit:
            seq = self.running[i]
            if seq.num_uncomputed_tokens != 1 or self._reached_length(seq) or seq in busy:
                i += 1      # a chunked prompt waiting for blocks, a beam waiting for its siblings, done, or in flight
                continue
            position = seq.num_computed_tokens
            # a new block once every block_size tokens, and a copy of the last one if it is shared
            needed = bm.num_blocks_needed(seq, seq.num_tokens) + bm.num_shared_blocks(seq, position)
            if needed <= bm.num_free_blocks:
                bm.allocate(seq, seq.num_tokens)
                batch.block_copies += bm.copy_on_write(seq, position)
                batch.seqs.append(seq)
                i += 1
            else:
                popped = self._preempt_idle()
                if popped < 0:
                    self._preempt(self.running.pop())  # newest (or lowest priority) first; may be seq itself
                elif popped < i:
                    i -= 1
        batch.num_new_tokens = [1] * len(batch.seqs)
        return batch

    def speculates(self) -> bool:
        """Will a decode step now verify proposals? (The engine then collects every step first.) Not
        while a sequence runs under a grammar: each proposed position would need its own token mask."""
        return (self.num_speculative_tokens > 0 and len(self.running) <= SPECULATION_MAX_RUNNING
                and all(seq.grammar is None for seq in self.running))

    def draft_lengths(self, batch: ScheduledBatch) -> list[int]:
        """How many proposals each sequence of a decode batch may verify (0: none): at most k, within
        the step's token budget, and never past max_tokens or max_model_len with the token sampled
        after them."""
        budget = self.max_num_batched_tokens - len(batch.seqs)
        lengths = []
        for seq in batch.seqs:
            k = 0
            if seq.pending_row is None and seq.beam_search is None:
                k = max(0, min(self.num_speculative_tokens, budget, self.max_model_len - seq.num_tokens - 1,
                               seq.sampling_params.max_tokens - seq.num_completion_tokens - 1))
            lengths.append(k)
            budget -= k
        return lengths

    def add_drafts(self, batch: ScheduledBatch, proposals: list[list[int]]) -> None:
        """Reserve blocks for each sequence's proposals; one whose blocks do not fit decodes plainly
        (speculation never preempts)."""
        bm = self.block_manager
        drafts = [[] for _ in batch.seqs]
        for i, (seq, proposal) in enumerate(zip(batch.seqs, proposals)):
            if proposal and bm.can_allocate(seq, seq.num_tokens + len(proposal)):
                bm.allocate(seq, seq.num_tokens + len(proposal))
                drafts[i] = proposal
                batch.num_new_tokens[i] += len(proposal)
        if any(drafts):
            batch.draft_token_ids = drafts

    def _preempt_idle(self) -> int:
        """Preempt the newest running sequence that has nothing to compute (a beam waiting for its
        siblings: it holds blocks it does not need until the beams are chosen); its index in
        running, or -1 if there is none."""
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].num_uncomputed_tokens == 0:
                self._preempt(self.running.pop(i))
                return i
        return -1

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, batch: ScheduledBatch, row_offset: int = 0) -> list[Sequence]:
        """Record what a launched step computes, before its tokens are known: each sequence that
        samples gets a pending token (see Sequence.pending_row), in the device's rows of sampled ids
        from `row_offset` (LaunchedStep.row_offset). Returns those sequences."""
        sampled = batch.sampled_seqs()
        block_size = self.block_manager.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:                         # stopped by the step before, whose tokens came late
                continue
            if not batch.is_prefill:
                n = 1                                   # proposals count once accepted (fill_verified)
            before = seq.num_computed_tokens
            seq.num_computed_tokens += n
            if before // block_size != seq.num_computed_tokens // block_size:
                self.block_manager.cache_computed_blocks(seq, before)
            if seq.num_forks_due and seq.num_computed_tokens == seq.prefill_target:
                self._fork(seq)
        for row, seq in enumerate(sampled):
            if not seq.is_finished:
                seq.pending_row = row_offset + row
        return sampled

    def fill(self, seqs: list[Sequence], token_ids: list[int],
             logprobs: list[dict[int, float] | None] | None = None) -> list[Sequence]:
        """Put each sampled token in its sequence's pending place and stop the sequences it ends;
        returns the sequences that received a token."""
        grown = []
        for i, seq in enumerate(seqs):
            if seq.is_finished:                         # stopped before this step's token arrived
                continue
            seq.append_token(token_ids[i], logprobs[i] if logprobs else None)
            self.num_generation_tokens += 1
            grown.append(seq)
            reason = self._stop_reason(seq)
            if reason:
                self.finish(seq, reason)
        return grown

    def fill_verified(self, seqs: list[Sequence], token_ids: list[list[int]],
                      logprobs: list[list[dict[int, float] | None]], num_accepted: list[int],
                      num_drafts: list[int], after_token: Callable[[Sequence], None]) -> list[Sequence]:
        """fill for a verify step: each sequence gets its accepted proposals and one more token, one
        at a time (after_token applies the engine's stop strings), so that nothing follows a stop.
        Returns the sequences that received tokens."""
        grown = []
        for seq, tokens, token_logprobs, accepted, drafted in zip(seqs, token_ids, logprobs, num_accepted, num_drafts):
            if seq.is_finished:
                continue
            if drafted:
                self.num_drafts += 1
                self.num_draft_tokens += drafted
                self.num_accepted_tokens += accepted
            for token, token_logprob in zip(tokens, token_logprobs):
                self.fill([seq], [token], [token_logprob])
                after_token(seq)
                if seq.is_finished:
                    break
            grown.append(seq)
            if not seq.is_finished:
                before = seq.num_computed_tokens
                seq.num_computed_tokens += accepted
                self.block_manager.cache_computed_blocks(seq, before)
                self.block_manager.free_beyond(seq, seq.num_tokens)
        return grown

    def _stop_reason(self, seq: Sequence) -> str | None:
        params = seq.sampling_params
        num_generated = seq.num_completion_tokens
        if num_generated >= params.min_tokens:
            token_id = seq.last_token_id
            if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
                return "stop"
        if self._reached_length(seq):
            return "length"
        return None

    def _reached_length(self, seq: Sequence) -> bool:
        return seq.num_completion_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq (a stop, or "abort"): its blocks are free at once, even if a step in flight still
        computes it; that step's token for it is then dropped (see fill)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.pending_row = None
        self.block_manager.free(seq)
        # a sequence preempted while its last token was still being sampled waits in the queue
        (self.running if seq in self.running else self.waiting).remove(seq)

    def reset(self) -> None:
        """Forget the steps in flight: every running sequence goes back to the front of the queue, in
        admission order, with no blocks and no pending token, to be recomputed. Whatever half-done
        allocation an interruption left, the pool comes back whole (BlockManager.reset)."""
        self.waiting.extendleft(reversed(self.running))
        self.running.clear()
        for seq in self.waiting:
            seq.status = SequenceStatus.WAITING
            seq.pending_row = None
            seq.block_table.clear()
            seq.num_computed_tokens = 0
        self.block_manager.reset()
