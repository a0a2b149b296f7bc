"""The engine loop: requests in, tokens out. Tokenizes, validates, steps the scheduler and the
model runner, applies stop strings, and builds the outputs."""
import time

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import LaunchedStep, ModelRunner
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, model: str, **engine_args):
        config = Config.from_engine_args(model, **engine_args)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.model_runner = ModelRunner(config)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        # The host prepares step N+1 while the device runs step N, whose tokens it collects after.
        # Tensor-parallel workers need every step's token ids on the host first, so they do not.
        self.overlap = config.tensor_parallel_size == 1
        self.in_flight: LaunchedStep | None = None
        self.num_prefill_tokens = self.num_decode_tokens = 0   # of the last step, for the progress bar
        capacity = self.model_runner.num_kvcache_blocks * config.kvcache_block_size
        print(f"nanovllm: {config.model_config.num_layers}-layer {config.model_config.architecture} on {config.device} "
              f"({str(config.torch_dtype).removeprefix('torch.')}), KV cache {self.model_runner.num_kvcache_blocks} "
              f"blocks x {config.kvcache_block_size} tokens = {capacity} tokens")

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and free device memory; the engine cannot be used after."""
        if self.model_runner is not None:
            self.model_runner.close()
            self.model_runner = self.in_flight = None

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

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

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id (the `request_id` of its output)."""
        sampling_params = _check_sampling_params(sampling_params or SamplingParams())
        return self._add(self.encode_prompt(prompt), sampling_params)

    def _add(self, token_ids: list[int], sampling_params: SamplingParams) -> int:
        seq = Sequence(token_ids, sampling_params)
        self.scheduler.add(seq)
        return seq.seq_id

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.in_flight is None

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[dict]:
        """Run one scheduled step; returns the outputs of the requests it finished."""
        if self.model_runner is None:
            raise RuntimeError("this engine has been shut down; create a new LLM")
        batch = self.scheduler.schedule()
        launched = self.model_runner.launch(batch) if batch.seqs else None
        finished = self._collect() if self.in_flight else []     # the step before, done meanwhile
        if launched is not None:
            self.scheduler.advance(batch)
            self.in_flight = launched
            if not self.overlap:
                finished += self._collect()
        self.num_prefill_tokens = batch.num_tokens if batch.is_prefill else 0
        self.num_decode_tokens = 0 if batch.is_prefill else batch.num_tokens
        return finished

    def _collect(self) -> list[dict]:
        """Wait for the step in flight, put its tokens in place; outputs of the requests it ended."""
        step, self.in_flight = self.in_flight, None
        token_ids, logprobs = self.model_runner.collect(step)
        grown = self.scheduler.fill(step.seqs, token_ids, logprobs)
        self._apply_stop_strings(grown)
        return [self._output(seq) for seq in grown if seq.is_finished]

    def _apply_stop_strings(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            params = seq.sampling_params
            if not params.stop or seq.num_completion_tokens < params.min_tokens:
                continue
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
            cuts = [i for i in (text.find(s) for s in params.stop) if i >= 0]
            if cuts:
                seq.text = text[:min(cuts)]
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self.scheduler.finish(seq, "stop")

    def _output(self, seq: Sequence) -> dict:
        seq.finish_time = seq.finish_time or time.perf_counter()
        text = seq.text
        if text is None:
            text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
        first = seq.first_token_time or seq.finish_time
        num_out = seq.num_completion_tokens
        return {
            "request_id": seq.seq_id,
            "text": text,
            "token_ids": seq.completion_token_ids,
            "prompt_token_ids": seq.token_ids[:seq.num_prompt_tokens],
            "finish_reason": seq.finish_reason,
            "num_cached_tokens": seq.num_cached_tokens,
            "logprobs": seq.logprobs,
            "metrics": {
                "time_to_first_token": first - seq.arrival_time,
                "time_per_output_token": (seq.finish_time - first) / (num_out - 1) if num_out > 1 else 0.0,
                "latency": seq.finish_time - seq.arrival_time,
            },
        }

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        # validate everything before any work starts, so a bad request leaves the engine untouched
        requests = [(self.encode_prompt(p), _check_sampling_params(sp)) for p, sp in zip(prompts, sampling_params)]
        ids = [self._add(token_ids, sp) for token_ids, sp in requests]
        order = {request_id: i for i, request_id in enumerate(ids)}
        outputs: list[dict | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_rate = decode_rate = 0.0
        remaining = len(ids)
        try:
            while remaining:
                start = time.perf_counter()
                finished = self.step()
                elapsed = time.perf_counter() - start
                if self.num_prefill_tokens:
                    prefill_rate = self.num_prefill_tokens / elapsed
                elif self.num_decode_tokens:     # (a last step may only collect the one before)
                    decode_rate = self.num_decode_tokens / elapsed
                bar.set_postfix_str(f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s",
                                    refresh=False)
                for output in finished:
                    i = order.get(output["request_id"])
                    if i is not None:
                        outputs[i] = output
                        remaining -= 1
                        bar.update(1)
        finally:
            bar.close()
        return outputs


def _check_sampling_params(sampling_params) -> SamplingParams:
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    return sampling_params
