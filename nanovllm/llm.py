"""The user-facing entry point: `LLM(path, **engine_args).generate(prompts, sampling_params)`.

LLM holds an LLMEngine (`llm.engine`: add_request, step, abort, is_finished, for callers that drive
it themselves) and runs whole batches on it: generate, chat, beam_search.
"""
import time
from collections.abc import Hashable

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.beam_search import BeamSearch
from nanovllm.engine.chat_template import Message
from nanovllm.engine.input_processor import Prompt, check_prompt_list, pair_prompts_with_params
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.pooling_params import PoolingParams
from nanovllm.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from nanovllm.utils.validation import priorities


class LLM:
    """An offline engine over one Hugging Face checkpoint of a supported family (docs/models.md)."""

    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(model, **engine_args)

    @property
    def config(self) -> Config:
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        """Gauges and cumulative counters for monitoring (LLMEngine.stats)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and free device memory; the LLM cannot be used after."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | list[int] = 0) -> list[dict]:
        """Generate for every prompt; outputs come back in prompt order. `priority`: one for all
        prompts or one per prompt (lower first, under scheduling_policy="priority"). If anything
        interrupts the call, its requests are aborted and the engine stays usable."""
        engine = self.engine
        engine.check_running()
        # validate everything before any work starts, so a bad request leaves the engine untouched
        requests = [(engine.inputs.encode_prompt(p), engine.inputs.check_sampling_params(sp))
                    for p, sp in pair_prompts_with_params(prompts, sampling_params)]
        ranks = priorities(priority, len(requests))
        return self._run_until_done([engine.add_checked(token_ids, sp, priority=rank)
                                     for (token_ids, sp), rank in zip(requests, ranks)], use_tqdm)

    def embed(self, prompts: list[Prompt], dimensions: int | None = None, use_tqdm: bool = False,
              priority: int | list[int] = 0) -> list[dict]:
        """The embedding of every prompt, in order (an engine of runner="pooling"; docs/embeddings.md):
        one dict per prompt whose `embedding` is its last token's final hidden state, L2-normalised,
        truncated to `dimensions` and normalised again when given."""
        engine = self.engine
        engine.check_running()
        check_prompt_list(prompts)
        params = engine.inputs.check_pooling_params(PoolingParams(dimensions))
        token_ids = [engine.inputs.encode_prompt(p) for p in prompts]
        ranks = priorities(priority, len(token_ids))
        return self._run_until_done([engine.add_checked(ids, params, priority=rank)
                                     for ids, rank in zip(token_ids, ranks)], use_tqdm)

    def beam_search(self, prompts: list[Prompt], params: BeamSearchParams, use_tqdm: bool = False) -> list[dict]:
        """Beam search for every prompt (see engine/beam_search.py); one dict per prompt, in order,
        whose `sequences` are the beam_width best beams, best first."""
        engine = self.engine
        engine.check_running()
        check_prompt_list(prompts)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.validate()
        token_ids = [engine.inputs.encode_prompt(p) for p in prompts]
        ids = []
        for prompt in token_ids:
            max_tokens = min(params.max_tokens, self.config.max_model_len - len(prompt))
            # each beam computes its chosen tokens; its own logprobs at temperature 1 propose the next
            request_id = engine.add_checked(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                   ignore_eos=True,
                                                                   logprobs=min(2 * params.beam_width, MAX_LOGPROBS)))
            root = engine.core.requests[request_id]
            root.beam_search = BeamSearch(params, root, self.config.eos_token_ids, max_tokens)
            ids.append(request_id)
        return self._run_until_done(ids, use_tqdm)

    def _run_until_done(self, ids: list[Hashable], use_tqdm: bool) -> list[dict]:
        """Step until every request in ids finished; their outputs in that order. On any exception
        they are aborted (others are not) and it is raised again."""
        engine = self.engine
        outputs: dict[Hashable, dict] = {}
        wanted = set(ids)
        bar = None
        try:
            bar = tqdm(total=len(ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
            prefill_rate = decode_rate = 0.0
            while len(outputs) < len(ids):
                start = time.perf_counter()
                engine.run_step()
                elapsed = time.perf_counter() - start
                core = engine.core
                if core.num_prefill_tokens:
                    prefill_rate = core.num_prefill_tokens / elapsed
                elif core.num_decode_tokens:     # (a last step may only collect the one before)
                    decode_rate = core.num_decode_tokens / elapsed
                postfix = f"prefill {prefill_rate:,.0f} tok/s, decode {decode_rate:,.0f} tok/s"
                if core.scheduler.num_draft_tokens:
                    postfix += f", accepted {core.scheduler.num_accepted_tokens / core.scheduler.num_draft_tokens:.0%}"
                bar.set_postfix_str(postfix, refresh=False)
                done = [request_id for request_id in engine.finished_outputs if request_id in wanted]
                for request_id in done:
                    outputs[request_id] = engine.take_output(request_id)
                bar.update(len(done))
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [outputs[request_id] for request_id in ids]

    # ---- rollout control (docs/rollout.md; LLMEngine's, engine/rollout.py) -------------------------

    def update_weights(self, weights, weight_version: int | None = None) -> int:
        """Load (checkpoint name, tensor) pairs in place; returns the new weight_version."""
        return self.engine.update_weights(weights, weight_version)

    def update_weights_from_disk(self, path: str, weight_version: int | None = None) -> int:
        return self.engine.update_weights_from_disk(path, weight_version)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str = "nccl") -> None:
        self.engine.init_weight_update_group(master_address, master_port, rank_offset, world_size, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        weight_version: int | None = None) -> int:
        return self.engine.update_weights_from_distributed(names, dtypes, shapes, weight_version)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[Message], tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of one conversation under the tokenizer's chat template, ready for the reply."""
        return self.engine.inputs.apply_chat_template(messages, tools, chat_template_kwargs)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params=None,
             use_tqdm: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[dict]:
        """Reply to one conversation or to each of a list of them; then as generate. The template
        renders `tools` and reads `chat_template_kwargs` (e.g. {"enable_thinking": False})."""
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = [self.apply_chat_template(conversation, tools, chat_template_kwargs) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
