"""The engine: requests in, outputs out, in three parts as vLLM v1 has them.

- the input processor (input_processor.py) tokenizes and validates a request into a Sequence;
- the engine core (core.py) schedules, launches, collects and recovers, step after step;
- the output processor (output_processor.py) detokenizes, applies stop strings, streams deltas and
  builds each finished request's output dict.

A finished request's output waits in `finished_outputs` until a call returns it, so none is lost and
none is returned twice. The LLM class (llm.py) runs generate/chat/beam_search on top of this.
"""
from collections.abc import Callable, Hashable

from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.engine.core import EngineCore
from nanovllm.engine.input_processor import InputProcessor, Prompt
from nanovllm.engine.output_processor import OutputProcessor, RequestUpdate
from nanovllm.engine.grammars import StructuredOutputManager
from nanovllm.engine.rollout import EngineRollout
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.validation import check_priority


class LLMEngine(EngineRollout):
    """Rollout control (update_weights, sleep, wake_up, weight_version) is EngineRollout's (rollout.py)."""

    def __init__(self, model: str, **engine_args):
        config = Config.from_engine_args(model, **engine_args)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.structured: StructuredOutputManager | None = None   # made by the first constrained request
        self.inputs = InputProcessor(config, self.tokenizer, self._grammars)
        self.outputs = OutputProcessor(self.tokenizer)
        self.core: EngineCore | None = EngineCore(config, self.outputs.finds_stop)
        self.finished_outputs: dict[Hashable, dict] = {}    # finished, not yet returned
        executor = self.core.executor
        capacity = executor.num_kvcache_blocks * config.kvcache_block_size
        quantization = config.model_config.quantization
        dtype = str(config.torch_dtype).removeprefix('torch.')
        weights_format = quantization.describe() if quantization else dtype
        print(f"nanovllm: {config.model_config.num_layers}-layer {config.model_config.architecture} on {config.device} "
              f"({dtype}), weights {executor.driver.weight_bytes / 2**30:.3g} GiB per rank ({weights_format}), "
              f"KV cache {executor.num_kvcache_blocks} blocks x {config.kvcache_block_size} tokens = {capacity} tokens"
              + (f", host tier {executor.num_host_blocks} blocks" if config.kv_offload_gib else ""))

    def _grammars(self) -> StructuredOutputManager:
        if self.structured is None:
            self.structured = StructuredOutputManager(self.tokenizer, self.config.model_config.vocab_size,
                                                      self.config.eos_token_ids, self.config.device == "cuda")
        return self.structured

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and free device memory; the engine cannot be used after."""
        if self.core is not None:
            self.core.shutdown()
            self.core = None

    def check_running(self) -> None:
        if self.core is None:
            raise RuntimeError("this engine has been shut down; create a new LLM")

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | PoolingParams | None = None,
                    request_id: Hashable | None = None, priority: int = 0) -> Hashable:
        """Queue one request; returns its id (the `request_id` of its output): the one given, or a
        new int. `priority`: lower first, under scheduling_policy="priority". A runner="pooling" engine
        takes PoolingParams (the default there). Everything is checked before anything is queued."""
        self.check_running()
        default = PoolingParams() if self.config.runner == "pooling" else SamplingParams()
        sampling_params = self.inputs.check_sampling_params(sampling_params or default)
        check_priority(priority)
        if request_id is not None and request_id in self.core.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self.add_checked(self.inputs.encode_prompt(prompt), sampling_params, request_id, priority)

    def add_checked(self, token_ids: list[int], sampling_params: SamplingParams | PoolingParams,
                    request_id: Hashable | None = None, priority: int = 0) -> Hashable:
        """Queue a request whose prompt and parameters were checked already."""
        self.check_awake()
        seq = self.inputs.new_sequence(token_ids, sampling_params, request_id, priority)
        self.core.add(seq)
        return seq.request_id

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request: its blocks are freed at once (also while a step in flight computes it) and
        nothing more is reported for it. False if no such request is live or waiting to be returned."""
        first = self.core.abort(request_id)
        if first is None:
            return False
        self.finished_outputs.pop(request_id, None)
        self.outputs.forget(first)
        return True

    def is_finished(self) -> bool:
        """Nothing waiting, running, in flight, or finished but not yet returned."""
        return self.core.is_finished()

    def stats(self) -> dict:
        """Gauges and cumulative counters for monitoring."""
        grammars = self.structured
        return {
            **self.core.stats(),
            # structured outputs: host seconds spent filling token masks, the steps and rows masked
            "structured_output_mask_seconds": grammars.mask_seconds if grammars else 0.0,
            "structured_output_accept_seconds": grammars.accept_seconds if grammars else 0.0,
            "structured_output_mask_steps": grammars.num_masked_steps if grammars else 0,
            "structured_output_masked_rows": grammars.num_masked_rows if grammars else 0,
        }

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[dict]:
        """Run one scheduled step; returns the outputs of finished requests, each exactly once."""
        self.run_step()
        return [self.take_output(request_id) for request_id in list(self.finished_outputs)]

    def step_updates(self, due: Callable[[Hashable], bool] | None = None, drain: bool = False) -> list[RequestUpdate]:
        """Run one scheduled step; how every sequence that advanced in it did, with text deltas. The
        update that ends a request (the last of its completions to finish) carries its output. (Beam
        searches report only at the end, to beam_search or step.) With `due`, a request for which
        it is False reports only a completion's end; its other tokens come with a later update.
        `drain`: only collect the step in flight, launch none (AsyncLLM.pause_generation)."""
        requests = self.core.requests
        advanced = {id(seq): seq for seq in self.run_step(drain)
                    if seq.request_id in requests and seq.beam_search is None}
        for request_id in self.finished_outputs:      # also endings an interrupted step left unreported
            if requests[request_id].beam_search is None:
                for seq in requests[request_id].group:
                    advanced.setdefault(id(seq), seq)
        updates = self.outputs.updates(list(advanced.values()), due)
        for update in reversed(updates):              # the last update of a finished request
            if update.request_id in self.finished_outputs:
                update.output = self.take_output(update.request_id)
        return updates

    def run_step(self, drain: bool = False) -> list[Sequence]:
        """One engine-core step (or, drain, only the collection of the one in flight); the outputs
        of the requests it finished wait in finished_outputs."""
        self.check_running()
        try:
            return self.core.drain(self.structured) if drain else self.core.step(self.structured)
        finally:       # also after an interrupted step: its recovery notes what had finished
            for request_id in self.core.finished:
                self.finished_outputs[request_id] = self.outputs.build_output(self.core.requests[request_id])
            self.core.finished.clear()

    def take_output(self, request_id: Hashable) -> dict:
        """Hand out a finished request's output; the engine forgets the request."""
        first = self.core.forget(request_id)
        if first is not None:
            self.outputs.forget(first)
        return self.finished_outputs.pop(request_id)
