"""The engine core: schedule a step, launch it, collect the step before it, recover from anything.

The host prepares step N+1 while the device runs step N, whose tokens it collects after (the
overlap), also under tensor parallelism; a step that speculates or samples beams is collected
before the next is scheduled. Under pipeline parallelism (P stages) P steps stay in flight, one per
stage, while the host prepares the next: the oldest is collected once the next is launched, or when
nothing else can be scheduled. The next step may take the sequences of the oldest when their tokens
are read on the device (P batches take turns), never those of the others (Scheduler.schedule's `busy`).
Sequences are the core's currency: it never sees text (stop strings are the output processor's,
asked through `finds_stop`) and never builds an output; it lists the requests that finished
(`finished`), and the engine above turns them into outputs.

Whatever is raised inside a step (an error, or Ctrl-C while the host waits for the device), `recover`
drops the steps in flight and takes every live sequence back to the queue, to be recomputed
(Scheduler.reset): one recovery for every point of the loop.
"""
from collections import deque
from collections.abc import Callable, Hashable

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.engine.beam_search import BeamSearch
from nanovllm.engine.grammars import StructuredOutputManager
from nanovllm.executor.executor import Executor, LaunchedStep
from nanovllm.spec_decode.draft_proposer import DraftProposer
from nanovllm.spec_decode.ngram_proposer import NgramProposer


class EngineCore:
    def __init__(self, config: Config, finds_stop: Callable[[Sequence], bool]):
        self.config = config
        self._finds_stop = finds_stop         # the output processor's: it holds the text
        spec = config.speculative_config
        # a draft model first: its memory comes out of what the target then sizes its KV pool from
        self.proposer = None if spec is None else (DraftProposer(config) if spec.model is not None else
                                                   NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
        self.executor = Executor(config)
        self.scheduler = Scheduler(config, self._new_block_manager(),
                                   0 if spec is None else spec.num_speculative_tokens)
        # Tensor-parallel ranks all hold the sampled ids on their device (Worker.run). A pooling
        # request ends with its prefill and must finish before the next step is scheduled: no overlap.
        self.overlap = config.runner == "generate"
        # Steps left in flight while the host prepares the next: one, or one per pipeline stage
        self.max_in_flight = config.pipeline_parallel_size
        self.pipelined = config.pipeline_parallel_size > 1
        self.in_flight: deque[LaunchedStep] = deque()     # oldest first
        self.requests: dict[Hashable, Sequence] = {}   # first sequence of each live or unreturned request
        self.finished: list[Hashable] = []             # requests done since the engine last looked
        self.num_prefill_tokens = self.num_decode_tokens = 0   # of the last step, for the progress bar

    def _new_block_manager(self) -> BlockManager:
        return BlockManager(self.executor.num_kvcache_blocks, self.config.kvcache_block_size,
                            self.config.enable_prefix_caching, self.executor.num_host_blocks)

    def shutdown(self) -> None:
        self.executor.close()
        self.in_flight.clear()
        if self.proposer is not None:
            self.proposer.close()

    # ---- requests ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: Hashable) -> Sequence | None:
        """Finish a request's live sequences (their blocks are free at once, also while a step in
        flight computes them) and forget it; its first sequence, or None if it was unknown."""
        first = self.requests.pop(request_id, None)
        if first is None:
            return None
        if request_id in self.finished:
            self.finished.remove(request_id)
        for seq in first.group:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        # a step none of whose tokens is wanted is dropped: the device finishes it unobserved
        self.in_flight = deque(step for step in self.in_flight if not all(s.is_finished for s in step.observed_seqs))
        self._free_draft_shadows()
        return first

    def forget(self, request_id: Hashable) -> Sequence | None:
        """A finished request the engine handed out: drop it."""
        return self.requests.pop(request_id, None)

    def is_finished(self) -> bool:
        return not self.requests and self.scheduler.is_finished() and not self.in_flight

    # ---- one step ------------------------------------------------------------------------------

    def step(self, grammars: StructuredOutputManager | None) -> list[Sequence]:
        """Schedule and launch a step, collect the one before; the sequences that got tokens. On any
        exception, recover and raise it again."""
        try:
            return self._step(grammars)
        except BaseException:
            self.recover()
            raise

    def drain(self, grammars: StructuredOutputManager | None) -> list[Sequence]:
        """Collect the steps in flight, launching none (before a pause); the sequences that got tokens."""
        try:
            return self._collect_all(grammars)
        except BaseException:
            self.recover()
            raise

    def _step(self, grammars: StructuredOutputManager | None) -> list[Sequence]:
        # proposals are made from every token so far: while speculating, no step overlaps the next
        speculates = self.scheduler.speculates()
        grown = self._collect_all(grammars) if speculates else []
        batch = self.scheduler.schedule(self._busy())
        if batch.seqs and not batch.is_prefill and self.scheduler.speculates():
            self._propose(batch)
        # A constrained sequence's mask depends on the token the step in flight is sampling for it:
        # its step runs the model now but samples only once that token is collected and the mask
        # filled, while the device computes this step's logits. Other batches sample at once.
        constrained = grammars is not None and any(seq.grammar is not None for seq in batch.seqs)
        launched = self.executor.launch(batch, sample=not constrained) if batch.seqs else None
        if self.in_flight and (launched is None or len(self.in_flight) >= self.max_in_flight):
            grown += self._collect(grammars)          # the oldest step, done meanwhile
        if launched is not None:
            if constrained and launched.logits is not None:   # under stages: sampled when collected
                self.executor.sample(launched, grammars.token_bitmask(launched.seqs))
            self.scheduler.advance(batch, launched.row_offset)
            self.in_flight.append(launched)
            # beams are chosen on the host before their next step: no overlap for a step with beams
            if (not self.overlap or speculates or launched.draft_lens is not None
                    or any(seq.beam_search is not None for seq in launched.seqs)):
                grown += self._collect_all(grammars)
        self.num_prefill_tokens = batch.num_tokens if batch.is_prefill else 0
        self.num_decode_tokens = 0 if batch.is_prefill else batch.num_tokens
        return grown

    def _busy(self) -> set[Sequence]:
        """Under pipeline stages, the sequences the next step may not take: those of the steps in
        flight, but for the oldest's when it is collected right after the launch and was sampled at
        its own launch (the next step reads their tokens on the device). Sequences of a later step
        in flight would then hold two pending tokens."""
        if not self.pipelined:
            return set()
        steps = list(self.in_flight)
        if len(steps) >= self.max_in_flight and steps[0].sampled:
            steps = steps[1:]
        return {seq for step in steps for seq in step.scheduled}

    def _propose(self, batch) -> None:
        """Ask the proposer for the decode batch's guesses; the scheduler reserves their slots."""
        lengths = self.scheduler.draft_lengths(batch)
        rows = [row for row, k in enumerate(lengths) if k > 0]
        if not rows:
            return
        proposals = [[] for _ in batch.seqs]
        for row, proposal in zip(rows, self.proposer.propose([batch.seqs[row] for row in rows],
                                                             [lengths[row] for row in rows])):
            proposals[row] = proposal
        self.scheduler.add_drafts(batch, proposals)

    def _collect_all(self, grammars: StructuredOutputManager | None) -> list[Sequence]:
        grown = []
        while self.in_flight:
            grown += self._collect(grammars)
        return grown

    def _collect(self, grammars: StructuredOutputManager | None) -> list[Sequence]:
        """Wait for the oldest step in flight and put its tokens in place; the sequences that got one."""
        step = self.in_flight.popleft()
        if step.draft_lens is not None:
            grown = self._collect_verified(step)
        elif step.embeddings is not None:
            grown = self._collect_pooled(step)
        else:
            grown = self._collect_sampled(step, grammars)
        self._free_draft_shadows()
        return grown

    def _collect_sampled(self, step: LaunchedStep, grammars: StructuredOutputManager | None) -> list[Sequence]:
        if not step.sampled:     # pipeline stages: its logits come now; no other step changed its grammars
            constrained = grammars is not None and any(seq.grammar is not None for seq in step.seqs)
            self.executor.sample(step, grammars.token_bitmask(step.seqs) if constrained else None)
        token_ids, logprobs = self.executor.collect(step)
        beams = [row for row, seq in enumerate(step.seqs) if seq.beam_search is not None]
        if beams:
            self._propose_beams(step.seqs, beams, logprobs)
            rows = [row for row, seq in enumerate(step.seqs) if seq.beam_search is None]
            seqs, token_ids = [step.seqs[row] for row in rows], [token_ids[row] for row in rows]
            logprobs = [logprobs[row] for row in rows]
        else:
            seqs = step.seqs
        grown = self.scheduler.fill(seqs, token_ids, logprobs)
        if grammars is not None:
            grammars.accept([seq for seq in grown if seq.grammar is not None])
        for seq in grown:
            if seq.grammar is not None and seq.grammar.finished and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
            self._after_token(seq)
        return grown

    def _collect_pooled(self, step: LaunchedStep) -> list[Sequence]:
        """A pooling step: each sequence whose prefill it finished gets its embedding and ends."""
        done = []
        for seq, embedding in zip(step.seqs, self.executor.collect_embeddings(step)):
            if seq.is_finished:                       # aborted while the step ran
                continue
            seq.embedding = embedding
            self.scheduler.finish(seq, "stop")
            self._note_if_done(seq.request_id)
            done.append(seq)
        return done

    def _collect_verified(self, step: LaunchedStep) -> list[Sequence]:
        token_ids, logprobs, num_accepted = self.executor.collect_verified(step)
        return self.scheduler.fill_verified(step.seqs, token_ids, logprobs, num_accepted, step.draft_lens,
                                            self._after_token)

    def finds_stop(self, seq: Sequence) -> bool:
        """Has seq's text reached one of its stop strings?"""
        return self._finds_stop(seq)

    def _after_token(self, seq: Sequence) -> None:
        """Stop strings, then note the request if this token ended it."""
        if seq.sampling_params.stop and self.finds_stop(seq):
            if seq.is_finished:
                seq.finish_reason = "stop"
            else:
                self.scheduler.finish(seq, "stop")
        if seq.is_finished:
            self._note_if_done(seq.request_id)

    def _free_draft_shadows(self) -> None:
        if isinstance(self.proposer, DraftProposer):
            self.proposer.free_gone()

    # ---- beam search ---------------------------------------------------------------------------

    def _propose_beams(self, seqs: list[Sequence], rows: list[int], logprobs: list[dict[int, float]]) -> None:
        """Record each beam's candidates; choose for every beam search whose live beams all have."""
        searches = {}
        for row in rows:
            beam = seqs[row]
            if beam.is_finished:
                continue
            beam.pending_row, beam.beam_candidates = None, logprobs[row]
            searches[id(beam.beam_search)] = beam.beam_search
        for search in searches.values():
            if search.ready():
                self._choose_beams(search)

    def _choose_beams(self, search: BeamSearch) -> None:
        """Continue the chosen beams (forking those continued more than once), drop the others."""
        continuations = search.choose()
        uses: dict[int, list] = {}
        for continuation in continuations:
            uses.setdefault(id(continuation.beam), []).append(continuation)
        live = []
        for beam in search.live:
            mine = uses.get(id(beam), [])
            beams = [beam] + [self.scheduler.fork(beam) for _ in mine[1:]]   # fork before beam grows
            for seq, continuation in zip(beams, mine):
                seq.append_token(continuation.token_id)
                seq.cum_logprob, seq.beam_candidates = continuation.cum_logprob, None
                live.append((continuation, seq))
            if not mine:
                self.scheduler.finish(beam, "length")
        order = {id(c): i for i, c in enumerate(continuations)}
        search.live = [seq for _, seq in sorted(live, key=lambda pair: order[id(pair[0])])]
        if search.done:
            self._note_if_done(search.request_id)

    # ---- finished requests and recovery ----------------------------------------------------------

    def _note_if_done(self, request_id: Hashable) -> None:
        first = self.requests.get(request_id)
        if first is None or request_id in self.finished:
            return
        done = first.beam_search.done if first.beam_search is not None else all(s.is_finished for s in first.group)
        if done:
            self.finished.append(request_id)

    def recover(self) -> None:
        self.in_flight.clear()
        self.executor.discard_in_flight()
        self.scheduler.reset()
        if self.proposer is not None:
            self.proposer.reset()
        if self.executor.needs_restart:
            self._restart_executor()
        for request_id in list(self.requests):        # finished, but the step broke off before noting it
            self._note_if_done(request_id)

    def _restart_executor(self) -> None:
        """Tensor-parallel ranks left in different places of a step cannot meet again: start them
        anew, with a new (empty) KV pool."""
        self.executor.close()
        self.executor = Executor(self.config)
        self.scheduler.block_manager = self._new_block_manager()

    def stats(self) -> dict:
        """The scheduler's and block manager's gauges and counters (see LLMEngine.stats)."""
        sched, bm = self.scheduler, self.scheduler.block_manager
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_cache_usage": bm.num_used_blocks / len(bm.blocks),
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "prompt_tokens": sched.num_prompt_tokens,
            "generation_tokens": sched.num_generation_tokens,
            "spec_decode_num_drafts": sched.num_drafts,
            "spec_decode_num_draft_tokens": sched.num_draft_tokens,
            "spec_decode_num_accepted_tokens": sched.num_accepted_tokens,
            # the prefix cache's host tier (kv_offload_gib)
            "kv_offload_usage": bm.host.num_used_blocks / bm.host.num_blocks if bm.host else 0.0,
            "kv_offload_blocks_offloaded": bm.num_offloaded_blocks,
            "kv_offload_blocks_loaded": bm.num_loaded_blocks,
            "prefix_cache_host_hits": sched.prefix_cache_host_hits,
        }
