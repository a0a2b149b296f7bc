"""The engine loop: requests in, tokens out. Tokenizes, validates, steps the scheduler and the
model runner, applies stop strings, and builds the outputs.

Whatever is raised inside a step (an error, or Ctrl-C while the host waits for the device), the
engine drops the steps in flight and takes every live sequence back to the queue, to be recomputed
(Scheduler.reset): one recovery for every point of the loop. `generate` then aborts its own
requests; those of other callers carry on. A finished request's output waits in `finished_outputs`
until a call returns it, so none is lost and none is returned twice.
"""
import time
from collections.abc import Hashable
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import IncrementalDetokenizer
from nanovllm.worker.model_runner import LaunchedStep, ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


@dataclass(slots=True)
class RequestUpdate:
    """How one request advanced in a step, for streaming consumers."""
    request_id: Hashable
    index: int                    # completion index within the request
    new_token_ids: list[int]      # generated in this step
    delta_text: str               # never splits a character, never shows part of a stop string
    text: str                     # everything so far
    token_ids: list[int]          # every generated id so far
    finished: bool
    finish_reason: str | None
    output: dict | None           # the request's final output, once it finished


class LLMEngine:
    def __init__(self, model: str, **engine_args):
        config = Config.from_engine_args(model, **engine_args)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.model_runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self._new_block_manager())
        # The host prepares step N+1 while the device runs step N, whose tokens it collects after.
        # Tensor-parallel workers need every step's token ids on the host first, so they do not.
        self.overlap = config.tensor_parallel_size == 1
        self.in_flight: LaunchedStep | None = None
        self.requests: dict[Hashable, Sequence] = {}        # added, and not yet returned or aborted
        self.finished_outputs: dict[Hashable, dict] = {}    # finished, not yet returned
        self.detokenizers: dict[Hashable, IncrementalDetokenizer] = {}   # made when text is needed early
        self.num_prefill_tokens = self.num_decode_tokens = 0   # of the last step, for the progress bar
        capacity = self.model_runner.num_kvcache_blocks * config.kvcache_block_size
        print(f"nanovllm: {config.hf_config.num_hidden_layers}-layer Qwen3 on {config.device} "
              f"({str(config.torch_dtype).removeprefix('torch.')}), KV cache {self.model_runner.num_kvcache_blocks} "
              f"blocks x {config.kvcache_block_size} tokens = {capacity} tokens")

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    def _new_block_manager(self) -> BlockManager:
        return BlockManager(self.model_runner.num_kvcache_blocks, self.config.kvcache_block_size,
                            self.config.enable_prefix_caching)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and free device memory; the engine cannot be used after."""
        if self.model_runner is not None:
            self.model_runner.close()
            self.model_runner = self.in_flight = None

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
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return token_ids

    def check_sampling_params(self, sampling_params) -> SamplingParams:
        """Validate again (fields may have changed since construction), against this vocabulary."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        sampling_params.validate()
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in sampling_params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return sampling_params

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue one request; returns its id (the `request_id` of its output): the one given, or a
        new int. Everything is checked before anything is queued."""
        self._check_running()
        sampling_params = self.check_sampling_params(sampling_params or SamplingParams())
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self._add(self.encode_prompt(prompt), sampling_params, request_id)

    def _add(self, token_ids: list[int], sampling_params: SamplingParams, request_id: Hashable | None = None):
        seq = Sequence(token_ids, sampling_params, request_id)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request: its blocks are freed at once (also while a step in flight computes it) and
        nothing more is reported for it. False if no such request is live or waiting to be returned."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.finished_outputs.pop(request_id, None)
        self.detokenizers.pop(request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        if self.in_flight is not None and all(s.is_finished for s in self.in_flight.seqs):
            self.in_flight = None     # no token of it is wanted; the device finishes it unobserved
        return True

    def is_finished(self) -> bool:
        """Nothing waiting, running, in flight, or finished but not yet returned."""
        return not self.requests and self.scheduler.is_finished() and self.in_flight is None

    def has_unfinished_requests(self) -> bool:
        return not self.is_finished()

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
        }

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[dict]:
        """Run one scheduled step; returns the outputs of finished requests, each exactly once."""
        self._run_step()
        return [self._take_output(request_id) for request_id in list(self.finished_outputs)]

    def step_updates(self) -> list[RequestUpdate]:
        """Run one scheduled step; how every request that advanced in it did, with text deltas."""
        grown = self._run_step()
        advanced = {seq.request_id: seq for seq in grown if seq.request_id in self.requests}
        for request_id in self.finished_outputs:          # also outputs an interrupted step left
            advanced.setdefault(request_id, self.requests[request_id])
        updates = []
        for request_id, seq in advanced.items():
            detokenizer = self._detokenizer(seq)
            completion = seq.completion_token_ids
            detokenizer.update(completion, find_stop=False, final=seq.is_finished)   # stops: see _collect
            updates.append(RequestUpdate(
                request_id, 0, detokenizer.new_token_ids(completion), detokenizer.delta(final=seq.is_finished),
                detokenizer.visible_text, completion, seq.is_finished, seq.finish_reason,
                self._take_output(request_id) if seq.is_finished else None))
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
        batch = self.scheduler.schedule()
        launched = self.model_runner.launch(batch) if batch.seqs else None
        grown = self._collect() if self.in_flight else []     # the step before, done meanwhile
        if launched is not None:
            self.scheduler.advance(batch)
            self.in_flight = launched
            if not self.overlap:
                grown += self._collect()
        self.num_prefill_tokens = batch.num_tokens if batch.is_prefill else 0
        self.num_decode_tokens = 0 if batch.is_prefill else batch.num_tokens
        return grown

    def _collect(self) -> list[Sequence]:
        """Wait for the step in flight and put its tokens in place; the sequences that got one."""
        step, self.in_flight = self.in_flight, None
        token_ids, logprobs = self.model_runner.collect(step)
        grown = self.scheduler.fill(step.seqs, token_ids, logprobs)
        for seq in grown:
            if seq.sampling_params.stop:
                self._apply_stop_strings(seq)
            if seq.is_finished:
                self.finished_outputs[seq.request_id] = self._output(seq)
        return grown

    def _recover(self) -> None:
        self.in_flight = None
        self.scheduler.reset()
        if self.model_runner.needs_restart:
            self._restart_model_runner()
        for request_id, seq in self.requests.items():   # finished, but the step broke off before its output
            if seq.is_finished and request_id not in self.finished_outputs:
                self.finished_outputs[request_id] = self._output(seq)

    def _restart_model_runner(self) -> None:
        """Tensor-parallel ranks left in different places of a step cannot meet again: start them
        anew, with a new (empty) KV pool."""
        self.model_runner.close()
        self.model_runner = ModelRunner(self.config)
        self.scheduler.block_manager = self._new_block_manager()

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        detokenizer = self.detokenizers.get(seq.request_id)
        if detokenizer is None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.sampling_params.stop)
            self.detokenizers[seq.request_id] = detokenizer
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
        self.requests.pop(request_id, None)
        self.detokenizers.pop(request_id, None)
        return self.finished_outputs.pop(request_id)

    def _output(self, seq: Sequence) -> dict:
        seq.finish_time = seq.finish_time or time.perf_counter()
        detokenizer = self.detokenizers.get(seq.request_id)
        if detokenizer is not None:
            detokenizer.update(seq.completion_token_ids, find_stop=False, final=True)
            text = detokenizer.visible_text
        else:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
        first = seq.first_token_time or seq.finish_time
        num_out = seq.num_completion_tokens
        completion = {"text": text, "token_ids": seq.completion_token_ids, "finish_reason": seq.finish_reason,
                      "logprobs": seq.logprobs}
        return {
            "request_id": seq.request_id,
            **completion,
            "outputs": [completion],
            "prompt_token_ids": seq.token_ids[:seq.num_prompt_tokens],
            "num_cached_tokens": seq.num_cached_tokens,
            "metrics": {
                "time_to_first_token": first - seq.arrival_time,
                "time_per_output_token": (seq.finish_time - first) / (num_out - 1) if num_out > 1 else 0.0,
                "latency": seq.finish_time - seq.arrival_time,
            },
        }

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt; outputs come back in prompt order. If anything interrupts the
        call, its requests are aborted and the engine stays usable."""
        self._check_running()
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        # validate everything before any work starts, so a bad request leaves the engine untouched
        requests = [(self.encode_prompt(p), self.check_sampling_params(sp)) for p, sp in zip(prompts, sampling_params)]
        ids = [self._add(token_ids, sp) for token_ids, sp in requests]
        outputs: dict[Hashable, dict] = {}
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
                bar.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s",
                                    refresh=False)
                done = [request_id for request_id in ids if request_id in self.finished_outputs]
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

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        """Token ids of one conversation under the tokenizer's chat template, ready for the reply."""
        if self.tokenizer.chat_template is None:
            raise ValueError(f"messages: the tokenizer of {self.config.model!r} has no chat template")
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise TypeError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params=None,
             use_tqdm: bool = True) -> list[dict]:
        """Reply to one conversation or to each of a list of them; then as generate."""
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
