"""The engine loop: requests in, tokens out. Tokenizes, validates, steps the scheduler and the
model runner, applies stop strings, and builds the outputs.

Whatever is raised inside a step (an error, or Ctrl-C while the host waits for the device), the
engine drops the steps in flight and takes every live sequence back to the queue, to be recomputed
(Scheduler.reset): one recovery for every point of the loop. `generate` then aborts its own
requests; those of other callers carry on. A finished request's output waits in `finished_outputs`
until a call returns it, so none is lost and none is returned twice.
"""
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.beam_search import BeamSearch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.chat_template import Message, apply_chat_template
from nanovllm.engine.detokenizer import IncrementalDetokenizer, decode_many
from nanovllm.worker.model_runner import LaunchedStep, ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.structured_output import StructuredOutputManager
from nanovllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from nanovllm.spec_decode.draft_proposer import DraftProposer
from nanovllm.spec_decode.ngram_proposer import NgramProposer
from nanovllm.utils.validation import check_priority, priorities

Prompt = str | list[int]


@dataclass(slots=True)
class RequestUpdate:
    """How one request advanced in a step, for streaming consumers."""
    request_id: Hashable
    index: int                    # completion index within the request
    new_token_ids: list[int]      # generated in this step
    new_logprobs: list[dict[int, float]] | None   # theirs, when the request asked for logprobs
    delta_text: str               # never splits a character, never shows part of a stop string
    text: str                     # everything so far
    token_ids: list[int]          # every generated id so far
    finished: bool
    finish_reason: str | None
    output: dict | None           # the request's final output, once it finished


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


class LLMEngine:
    def __init__(self, model: str, **engine_args):
        config = Config.from_engine_args(model, **engine_args)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        spec = config.speculative_config
        # a draft model first: its memory comes out of what the target then sizes its KV pool from
        proposer = None if spec is None else (DraftProposer(config) if spec.model is not None else
                                              NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
        self.model_runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self._new_block_manager(), proposer,
                                   0 if spec is None else spec.num_speculative_tokens)
        # The host prepares step N+1 while the device runs step N, whose tokens it collects after.
        # Tensor-parallel workers need every step's token ids on the host first, so they do not.
        self.overlap = config.tensor_parallel_size == 1
        self.in_flight: LaunchedStep | None = None
        self.requests: dict[Hashable, Sequence] = {}        # first sequence of each request added, and
                                                            # not yet returned or aborted
        self.finished_outputs: dict[Hashable, dict] = {}    # finished, not yet returned
        # made when text is needed before a sequence ends (stop strings, streaming); by (request, index)
        self.detokenizers: dict[tuple[Hashable, int], IncrementalDetokenizer] = {}
        self.num_prefill_tokens = self.num_decode_tokens = 0   # of the last step, for the progress bar
        self.structured: StructuredOutputManager | None = None  # made by the first constrained request
        capacity = self.model_runner.num_kvcache_blocks * config.kvcache_block_size
        quantization = config.model_config.quantization
        weights_format = quantization.describe() if quantization else str(config.torch_dtype).removeprefix('torch.')
        print(f"nanovllm: {config.model_config.num_layers}-layer {config.model_config.architecture} on {config.device} "
              f"({str(config.torch_dtype).removeprefix('torch.')}), weights {self.model_runner.weight_bytes / 2**30:.3g} "
              f"GiB per rank ({weights_format}), KV cache {self.model_runner.num_kvcache_blocks} "
              f"blocks x {config.kvcache_block_size} tokens = {capacity} tokens"
              + (f", host tier {self.model_runner.num_host_blocks} blocks" if config.kv_offload_gib else ""))

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def _new_block_manager(self) -> BlockManager:
        return BlockManager(self.model_runner.num_kvcache_blocks, self.config.kvcache_block_size,
                            self.config.enable_prefix_caching, self.model_runner.num_host_blocks)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and free device memory; the engine cannot be used after."""
        if self.model_runner is not None:
            self.model_runner.close()
            self.model_runner = self.in_flight = None
            if self.scheduler.proposer is not None:
                self.scheduler.proposer.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _check_running(self) -> None:
        if self.model_runner is None:
            raise RuntimeError("this engine has been shut down; create a new LLM")

    # ---- requests ------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, or a ValueError/TypeError saying what is wrong with it."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            token_ids = list(prompt)
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len={limit} allows at most "
                             f"{limit - 1} so that at least one token can be generated")
        vocab_size = self.config.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return token_ids

    def check_sampling_params(self, sampling_params) -> SamplingParams:
        """Validate again (fields may have changed since construction), against this vocabulary."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params.validate()
        vocab_size = self.config.model_config.vocab_size
        bad = [t for t in sampling_params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if sampling_params.structured_outputs is not None:    # compiled (and cached) before any work
            self._structured_output_manager().compile(sampling_params.structured_outputs)
        return sampling_params

    def _structured_output_manager(self) -> StructuredOutputManager:
        if self.structured is None:
            self.structured = StructuredOutputManager(self.tokenizer, self.config.model_config.vocab_size,
                                                      self.config.eos_token_ids, self.config.device == "cuda")
        return self.structured

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: Hashable | None = None, priority: int = 0) -> Hashable:
        """Queue one request; returns its id (the `request_id` of its output): the one given, or a
        new int. `priority`: lower first, under scheduling_policy="priority". Everything is checked
        before anything is queued."""
        self._check_running()
        sampling_params = self.check_sampling_params(sampling_params or SamplingParams())
        check_priority(priority)
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self._add(self.encode_prompt(prompt), sampling_params, request_id, priority)

    def _add(self, token_ids: list[int], sampling_params: SamplingParams, request_id: Hashable | None = None,
             priority: int = 0):
        seq = Sequence(token_ids, sampling_params, request_id, priority)
        if sampling_params.structured_outputs is not None:
            seq.grammar = self.structured.new_grammar(sampling_params.structured_outputs, sampling_params.ignore_eos)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request: its blocks are freed at once (also while a step in flight computes it) and
        nothing more is reported for it. False if no such request is live or waiting to be returned."""
        first = self.requests.pop(request_id, None)
        if first is None:
            return False
        self.finished_outputs.pop(request_id, None)
        for seq in first.group:
            self.detokenizers.pop((request_id, seq.index), None)
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        if self.in_flight is not None and all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None     # no token of it is wanted; the device finishes it unobserved
        return True

    def is_finished(self) -> bool:
        """Nothing waiting, running, in flight, or finished but not yet returned."""
        return not self.requests and self.scheduler.is_finished() and self.in_flight is None

    def stats(self) -> dict:
        """Gauges and cumulative counters for monitoring."""
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
            # structured outputs: host seconds spent filling token masks, the steps and rows masked
            "structured_output_mask_seconds": self.structured.mask_seconds if self.structured else 0.0,
            "structured_output_accept_seconds": self.structured.accept_seconds if self.structured else 0.0,
            "structured_output_mask_steps": self.structured.num_masked_steps if self.structured else 0,
            "structured_output_masked_rows": self.structured.num_masked_rows if self.structured else 0,
        }

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[dict]:
        """Run one scheduled step; returns the outputs of finished requests, each exactly once."""
        self._run_step()
        return [self._take_output(request_id) for request_id in list(self.finished_outputs)]

    def step_updates(self, due: Callable[[Hashable], bool] | None = None) -> list[RequestUpdate]:
        """Run one scheduled step; how every sequence that advanced in it did, with text deltas. The
        update that ends a request (the last of its completions to finish) carries its output. (Beam
        searches report only at the end, to beam_search or step.) With `due`, a request for which
        it is False reports only a completion's end; its other tokens come with a later update."""
        advanced = {id(seq): seq for seq in self._run_step()
                    if seq.request_id in self.requests and seq.beam_search is None}
        for request_id in self.finished_outputs:      # also endings an interrupted step left unreported
            for seq in self.requests[request_id].group:
                if self.requests[request_id].beam_search is None:
                    advanced.setdefault(id(seq), seq)
        reporting = []
        for seq in advanced.values():
            detokenizer = self._detokenizer(seq)
            if not detokenizer.finished_sent and (due is None or seq.is_finished or due(seq.request_id)):
                completion = seq.completion_token_ids
                reporting.append((seq, detokenizer, completion, detokenizer.pending(completion)))
        texts = iter(decode_many(self.tokenizer, [ids for *_, pending in reporting for ids in pending]))
        updates = []
        for seq, detokenizer, completion, pending in reporting:
            detokenizer.update(completion, find_stop=False, final=seq.is_finished,   # stops: see _collect
                               decoded=[next(texts) for _ in pending])
            detokenizer.finished_sent = seq.is_finished
            new_logprobs = None if seq.logprobs is None else seq.logprobs[detokenizer.num_tokens_sent:]
            updates.append(RequestUpdate(
                seq.request_id, seq.index, detokenizer.new_token_ids(completion), new_logprobs,
                detokenizer.delta(final=seq.is_finished), detokenizer.visible_text, completion, seq.is_finished,
                seq.finish_reason, None))
        for update in reversed(updates):              # the last update of a finished request
            if update.request_id in self.finished_outputs:
                update.output = self._take_output(update.request_id)
        return updates

    def _run_step(self) -> list[Sequence]:
        """One step, or on any exception the recovery described at the top of this file."""
        self._check_running()
        try:
            return self._step()
        except BaseException:
            self._recover()
            raise

    def _step(self) -> list[Sequence]:
        # proposals are made from every token so far: while speculating, no step overlaps the next
        speculates = self.scheduler.speculates()
        grown = self._collect() if speculates and self.in_flight else []
        batch = self.scheduler.schedule()
        # A constrained sequence's mask depends on the token the step in flight is sampling for it:
        # its step runs the model now but samples only once that token is collected and the mask
        # filled, while the device computes this step's logits. Other batches sample at once.
        constrained = self.structured is not None and any(seq.grammar is not None for seq in batch.seqs)
        launched = self.model_runner.launch(batch, sample=not constrained) if batch.seqs else None
        grown += self._collect() if self.in_flight else []    # the step before, done meanwhile
        if launched is not None:
            if constrained and launched.seqs:
                self.model_runner.sample(launched, self.structured.token_bitmask(launched.seqs))
            self.scheduler.advance(batch)
            self.in_flight = launched
            # beams are chosen on the host before their next step: no overlap for a step with beams
            if (not self.overlap or speculates or launched.draft_lens is not None
                    or any(seq.beam_search is not None for seq in launched.seqs)):
                grown += self._collect()
        self.num_prefill_tokens = batch.num_tokens if batch.is_prefill else 0
        self.num_decode_tokens = 0 if batch.is_prefill else batch.num_tokens
        return grown

    def _collect(self) -> list[Sequence]:
        """Wait for the step in flight and put its tokens in place; the sequences that got one."""
        step, self.in_flight = self.in_flight, None
        if step.draft_lens is not None:
            return self._collect_verified(step)
        token_ids, logprobs = self.model_runner.collect(step)
        beams = [row for row, seq in enumerate(step.seqs) if seq.beam_search is not None]
        if beams:
            self._propose_beams(step.seqs, beams, logprobs)
            rows = [row for row, seq in enumerate(step.seqs) if seq.beam_search is None]
            seqs, token_ids = [step.seqs[row] for row in rows], [token_ids[row] for row in rows]
            logprobs = [logprobs[row] for row in rows]
        else:
            seqs = step.seqs
        grown = self.scheduler.fill(seqs, token_ids, logprobs)
        if self.structured is not None:
            self.structured.accept([seq for seq in grown if seq.grammar is not None])
        for seq in grown:
            if seq.grammar is not None and seq.grammar.finished and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
            if seq.sampling_params.stop:
                self._apply_stop_strings(seq)
            if seq.is_finished:
                self._store_output_if_done(seq.request_id)
        return grown

    def _collect_verified(self, step: LaunchedStep) -> list[Sequence]:
        token_ids, logprobs, num_accepted = self.model_runner.collect_verified(step)

        def after_token(seq: Sequence) -> None:
            if seq.sampling_params.stop:
                self._apply_stop_strings(seq)
            if seq.is_finished:
                self._store_output_if_done(seq.request_id)
        return self.scheduler.fill_verified(step.seqs, token_ids, logprobs, num_accepted, step.draft_lens,
                                            after_token)

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
            self._store_output_if_done(search.request_id)

    def _request_done(self, first: Sequence) -> bool:
        if first.beam_search is not None:
            return first.beam_search.done
        return all(seq.is_finished for seq in first.group)

    def _store_output_if_done(self, request_id: Hashable) -> None:
        first = self.requests.get(request_id)
        if first is not None and request_id not in self.finished_outputs and self._request_done(first):
            self.finished_outputs[request_id] = self._output(first)

    def _recover(self) -> None:
        self.in_flight = None
        self.scheduler.reset()
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.reset()
        if self.model_runner.needs_restart:
            self._restart_model_runner()
        for request_id in list(self.requests):        # finished, but the step broke off before its output
            self._store_output_if_done(request_id)

    def _restart_model_runner(self) -> None:
        """Tensor-parallel ranks left in different places of a step cannot meet again: start them
        anew, with a new (empty) KV pool."""
        self.model_runner.close()
        self.model_runner = ModelRunner(self.config)
        self.scheduler.block_manager = self._new_block_manager()

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        key = (seq.request_id, seq.index)
        detokenizer = self.detokenizers.get(key)
        if detokenizer is None:
            detokenizer = self.detokenizers[key] = IncrementalDetokenizer(self.tokenizer, seq.sampling_params.stop)
        return detokenizer

    def _apply_stop_strings(self, seq: Sequence) -> None:
        detokenizer = self._detokenizer(seq)
        detokenizer.update(seq.completion_token_ids, find_stop=seq.num_completion_tokens >= seq.sampling_params.min_tokens,
                           final=seq.is_finished)
        if detokenizer.stop_at is not None:
            if seq.is_finished:
                seq.finish_reason = "stop"
            else:
                self.scheduler.finish(seq, "stop")

    def _take_output(self, request_id: Hashable) -> dict:
        """Hand out a finished request's output; the engine forgets the request."""
        first = self.requests.pop(request_id, None)
        for seq in first.group if first is not None else ():
            self.detokenizers.pop((request_id, seq.index), None)
        return self.finished_outputs.pop(request_id)

    def _output(self, first: Sequence) -> dict:
        """A finished request's output: its completions (or, for a beam search, its best beams)."""
        now = time.perf_counter()
        output = {"request_id": first.request_id, "prompt_token_ids": first.token_ids[:first.num_prompt_tokens],
                  "num_cached_tokens": first.num_cached_tokens}
        if first.beam_search is not None:
            output["sequences"] = [{"token_ids": beam.token_ids, "text": self._decode(beam.token_ids),
                                    "cum_logprob": beam.cum_logprob, "finish_reason": beam.finish_reason}
                                   for beam in first.beam_search.best()]
            return output
        completions = []
        for seq in sorted(first.group, key=lambda seq: seq.index):
            seq.finish_time = seq.finish_time or now
            detokenizer = self.detokenizers.get((seq.request_id, seq.index))
            if detokenizer is not None:
                detokenizer.update(seq.completion_token_ids, find_stop=False, final=True)
                text = detokenizer.visible_text
            else:
                text = self._decode(seq.completion_token_ids)
            completions.append({"index": seq.index, "text": text, "token_ids": seq.completion_token_ids,
                                "finish_reason": seq.finish_reason, "logprobs": seq.logprobs})
        first_token = min((seq.first_token_time for seq in first.group if seq.first_token_time), default=now)
        finish = max(seq.finish_time for seq in first.group)
        num_out = first.num_completion_tokens
        return {
            **output,
            **{key: completions[0][key] for key in ("text", "token_ids", "finish_reason", "logprobs")},
            "outputs": completions,
            "metrics": {
                "time_to_first_token": first_token - first.arrival_time,
                "time_per_output_token": (first.finish_time - first_token) / (num_out - 1) if num_out > 1 else 0.0,
                "latency": finish - first.arrival_time,
            },
        }

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | list[int] = 0) -> list[dict]:
        """Generate for every prompt; outputs come back in prompt order. `priority`: one for all
        prompts or one per prompt (see add_request). If anything interrupts the call, its requests
        are aborted and the engine stays usable."""
        self._check_running()
        # validate everything before any work starts, so a bad request leaves the engine untouched
        requests = [(self.encode_prompt(p), self.check_sampling_params(sp))
                    for p, sp in pair_prompts_with_params(prompts, sampling_params)]
        ranks = priorities(priority, len(requests))
        return self._run_until_done([self._add(token_ids, sp, priority=rank)
                                     for (token_ids, sp), rank in zip(requests, ranks)], use_tqdm)

    def beam_search(self, prompts: list[Prompt], params: BeamSearchParams, use_tqdm: bool = False) -> list[dict]:
        """Beam search for every prompt (see engine/beam_search.py); one dict per prompt, in order,
        whose `sequences` are the beam_width best beams, best first."""
        self._check_running()
        check_prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.validate()
        token_ids = [self.encode_prompt(p) for p in prompts]
        ids = []
        for prompt in token_ids:
            max_tokens = min(params.max_tokens, self.config.max_model_len - len(prompt))
            # each beam computes its chosen tokens; its own logprobs at temperature 1 propose the next
            request_id = self._add(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                          logprobs=min(2 * params.beam_width, MAX_LOGPROBS)))
            root = self.requests[request_id]
            root.beam_search = BeamSearch(params, root, self.config.eos_token_ids, max_tokens)
            ids.append(request_id)
        return self._run_until_done(ids, use_tqdm)

    def _run_until_done(self, ids: list[Hashable], use_tqdm: bool) -> list[dict]:
        """Step until every request in ids finished; their outputs in that order. On any exception
        they are aborted (others are not) and it is raised again."""
        outputs: dict[Hashable, dict] = {}
        wanted = set(ids)
        bar = None
        try:
            bar = tqdm(total=len(ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
            prefill_rate = decode_rate = 0.0
            while len(outputs) < len(ids):
                start = time.perf_counter()
                self._run_step()
                elapsed = time.perf_counter() - start
                if self.num_prefill_tokens:
                    prefill_rate = self.num_prefill_tokens / elapsed
                elif self.num_decode_tokens:     # (a last step may only collect the one before)
                    decode_rate = self.num_decode_tokens / elapsed
                postfix = f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s"
                if self.scheduler.num_draft_tokens:
                    postfix += f", accepted {self.scheduler.num_accepted_tokens / self.scheduler.num_draft_tokens:.0%}"
                bar.set_postfix_str(postfix, refresh=False)
                done = [request_id for request_id in self.finished_outputs if request_id in wanted]
                for request_id in done:
                    outputs[request_id] = self._take_output(request_id)
                bar.update(len(done))
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [outputs[request_id] for request_id in ids]

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[Message], tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of one conversation under the tokenizer's chat template, ready for the reply."""
        return apply_chat_template(self.tokenizer, messages, self.config.model, tools, chat_template_kwargs)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params=None,
             use_tqdm: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[dict]:
        """Reply to one conversation or to each of a list of them; then as generate. The template
        renders `tools` and reads `chat_template_kwargs` (e.g. {"enable_thinking": False})."""
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = [self.apply_chat_template(conversation, tools, chat_template_kwargs) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
