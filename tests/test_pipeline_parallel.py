"""Pipeline parallelism over CPU processes (gloo): the same tokens and logprobs as one stage (and as
a plain transformers loop) with several batches in flight, under chunked prefill, preemption, prefix
hits, n > 1, a grammar, beams and an abort; an uneven split, stages of two tensor-parallel ranks
each, recovery with steps in flight, bad sizes, a dead stage, and shutdown. For every model
family, two stages, three on an uneven split and two stages of two tensor-parallel ranks each
give one stage's tokens and logprobs under chunked prefill, preemption and prefix hits."""
import contextlib
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from nanovllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from nanovllm.config import Config
from nanovllm.layers.parallel_state import stage_layers
from tests.conftest import mixed_prompts
from tests.test_interrupts import Injected, assert_consistent, fail_on_call, generate_until_ctrl_c, restore
from tests.test_models import LLAMA3_SCALING

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or (os.cpu_count() or 1) < 2,
                                reason="gloo stages on a CPU with 2+ cores")

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
GRAMMAR = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
# seeded sampling draws the same tokens from the same logits, whatever the batch
MIXED = [SamplingParams(temperature=1.3, seed=2, n=2, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=0.9, seed=3, max_tokens=12, structured_outputs=GRAMMAR),
         SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2),
         PARAMS]
BEAMS = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
# chunked prefill (32 tokens a step), a pool of 8 blocks, enough for one sequence of max_model_len
# but not for all at once (preemption)
TIGHT = dict(kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
             num_kvcache_blocks=8)


# Every family the registry runs, four layers each: two stages of 2 + 2, three of 1 + 2 + 1 (uneven).
# Tied and untied heads (a tied last stage holds its own copy of the embedding), q/k/v biases,
# llama3 rope scaling with GQA 4 (one KV head per rank under TP=2), and Qwen3-MoE with a dense layer
# closing the first stage and sparse layers on both sides of the boundary.
FAMILIES = {
    "qwen3": dict(seed=4),
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", seed=8, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, mlp_only_layers=[1], tie_word_embeddings=False),
    "llama3_tied_gqa4": dict(architecture="LlamaForCausalLM", seed=5, hidden_size=128, num_attention_heads=8,
                             num_key_value_heads=2, rope_scaling=LLAMA3_SCALING),
    "qwen2_bias_tied": dict(architecture="Qwen2ForCausalLM", seed=6),
    "mistral_untied": dict(architecture="MistralForCausalLM", seed=7, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory) -> dict[str, str]:
    return {name: write_tiny_model(str(tmp_path_factory.mktemp(name)), num_hidden_layers=4, **args)
            for name, args in FAMILIES.items()}


@pytest.fixture(scope="module")
def four_layers(family_paths) -> str:
    return family_paths["qwen3"]


@pytest.fixture(scope="module")
def five_layers_untied(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("pp5")), seed=5, num_hidden_layers=5,
                            tie_word_embeddings=False)


def prompts() -> list[list[int]]:
    shared = mixed_prompts(500, lengths=(40,), seed=7)[0]
    return mixed_prompts(500, lengths=(1, 17, 70, 5, 33)) + [shared + [7, 8], shared + [9] * 20]


def watch_in_flight(llm: LLM) -> tuple[list[int], list[int]]:
    """How many steps are in flight each time the core schedules one (checking that no sequence is in
    two of them), and how many sequences the step scheduled takes from the oldest of them (whose
    tokens it then reads on the device; never from the others), appended to the lists returned."""
    core, counts, taken = llm.engine.core, [], []
    schedule = core.scheduler.schedule

    def watched(busy=frozenset()):
        scheduled = [id(seq) for step in core.in_flight for seq in step.scheduled]
        assert len(scheduled) == len(set(scheduled))
        counts.append(len(core.in_flight))
        batch = schedule(busy)
        for newer in list(core.in_flight)[1:]:
            assert not set(batch.seqs) & set(newer.scheduled)
        taken.append(len(set(batch.seqs) & set(core.in_flight[0].scheduled)) if core.in_flight else 0)
        return batch
    core.scheduler.schedule = watched
    return counts, taken


def generate_with_an_abort(llm: LLM) -> list[list[int]]:
    """Requests added one by one and stepped; the second is aborted once it is in a step in flight
    and the queue of steps is full. The token ids of the others."""
    engine, core = llm.engine, llm.engine.core
    ids = [engine.add_request(p, PARAMS) for p in prompts()[:5]]
    outputs, aborted = {}, False
    while not engine.is_finished():
        outputs.update((out["request_id"], out) for out in engine.step())
        in_flight = {seq.request_id for step in core.in_flight for seq in step.scheduled}
        if not aborted and ids[1] in in_flight and len(core.in_flight) == core.max_in_flight:
            aborted = engine.abort(ids[1])
            assert_consistent(llm)
    assert aborted and sorted(outputs) == sorted(ids[:1] + ids[2:])
    assert core.scheduler.block_manager.num_used_blocks == 0
    return [outputs[i]["token_ids"] for i in ids[:1] + ids[2:]]


def run_workload(llm: LLM) -> dict:
    """On one engine: two identical greedy generate calls (the second hits the prefix cache), mixed
    requests (n = 2, a grammar, logprobs, prompt logprobs of a chunked prompt), a beam search, and
    requests stepped with one aborted.
    Their tokens (and greedy logprobs), the preemptions, the most steps ever in flight and how many
    sequences steps took from the oldest step in flight."""
    in_flight, taken = watch_in_flight(llm)
    greedy = [llm.generate(prompts(), PARAMS, use_tqdm=False) for _ in range(2)]
    assert all(run[-1]["num_cached_tokens"] >= 32 for run in greedy)     # the shared prefix's blocks
    mixed = llm.generate(prompts()[:4], MIXED, use_tqdm=False)
    beams = llm.beam_search(prompts()[1:3], BEAMS)
    return dict(greedy=[[(o["token_ids"], o["logprobs"]) for o in run] for run in greedy],
                mixed=[[c["token_ids"] for c in o["outputs"]] for o in mixed],
                prompt_logprobs=mixed[2]["prompt_logprobs"],
                beams=[[b["token_ids"] for b in o["sequences"]] for o in beams],
                aborted=generate_with_an_abort(llm),
                preemptions=llm.engine.core.scheduler.num_preemptions, max_in_flight=max(in_flight),
                taken_from_oldest=sum(taken))
def generate_twice(path: str, **engine_args) -> tuple[list, int]:
    """Outputs of two identical generate calls (the second hits the prefix cache), and the preemptions."""
    with oversubscribed(engine_args), LLM(path, **TIGHT, **engine_args) as llm:
        outputs = [llm.generate(prompts(), PARAMS, use_tqdm=False) for _ in range(2)]
        preemptions = llm.engine.core.scheduler.num_preemptions
    assert all(run[-1]["num_cached_tokens"] >= 32 for run in outputs)     # the shared prefix's blocks
    return [[(o["token_ids"], o["logprobs"]) for o in run] for run in outputs], preemptions


def assert_same(got, expected, tolerance: float) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        for entry, want in zip(logprobs, want_logprobs, strict=True):
            assert entry.keys() == want.keys()
            assert list(entry.values()) == pytest.approx(list(want.values()), abs=tolerance)


def assert_same_workload(got: dict, expected: dict, tolerance: float) -> None:
    """The same tokens; logprobs to float32 rounding (threads, batches and sums differ)."""
    for run in range(2):
        assert_same(got["greedy"][run], expected["greedy"][run], tolerance)
    for key in ("mixed", "beams", "aborted"):
        assert got[key] == expected[key], key
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(prompts()[2])
    assert_same([([], got["prompt_logprobs"][1:])], [([], expected["prompt_logprobs"][1:])], tolerance)
    assert expected["preemptions"] > 0 and got["preemptions"] > 0


@contextlib.contextmanager
def oversubscribed(engine_args: dict):
    """Three or four gloo processes on a machine of two cores are slow but correct: let Config allow
    them (it counts cores in this process only; the workers get the checked Config). Only as many
    cores as ranks: rank 0 takes cores / ranks threads, and more threads than cores spin."""
    ranks = engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "cpu_count", lambda cores=os.sysconf("SC_NPROCESSORS_ONLN"): max(ranks, cores))
        yield


@pytest.fixture(scope="module")
def one_stage(four_layers):
    with LLM(four_layers, **TIGHT) as llm:
        return run_workload(llm)


@pytest.fixture
def oversubscribe():
    with oversubscribed(dict(pipeline_parallel_size=4)):
        yield


def test_layer_split():
    assert [stage_layers(4, s, 2) for s in range(2)] == [(0, 2), (2, 4)]
    assert [stage_layers(5, s, 3) for s in range(3)] == [(0, 2), (2, 4), (4, 5)]   # the last stage is lightest
    assert [stage_layers(6, s, 4) for s in range(4)] == [(0, 1), (1, 3), (3, 5), (5, 6)]


def test_two_stages_match_one_and_recover(one_stage, four_layers, hf_greedy):
    with LLM(four_layers, **TIGHT, pipeline_parallel_size=2) as llm:
        got = run_workload(llm)
        assert one_stage["max_in_flight"] == 1 and got["max_in_flight"] == 2     # one step per stage
        assert got["taken_from_oldest"] > 50          # batches took turns, reading tokens on the device
        assert_same_workload(got, one_stage, 1e-4)
        assert_recovers_with_steps_in_flight(llm, [tokens for tokens, _ in one_stage["greedy"][0]])
    for prompt, (tokens, _) in list(zip(prompts(), one_stage["greedy"][0]))[:3]:     # and one stage is right
        assert tokens == hf_greedy(four_layers, prompt, PARAMS.max_tokens)


# Qwen3 runs the whole workload above; the other families the plain runs
@pytest.mark.parametrize("family", [name for name in FAMILIES if name != "qwen3"])
def test_every_family_matches_one_stage(family, family_paths, hf_greedy):
    """PP=2, PP=3 (uneven) and TP=2 x PP=2 against PP=1 on the same weights, under chunked prefill,
    preemption and prefix-cache hits: the same tokens, logprobs to float32 rounding (threads,
    batches and tensor-parallel sums differ)."""
    path = family_paths[family]
    expected, preemptions = generate_twice(path)
    assert preemptions > 0
    for prompt, (tokens, _) in list(zip(prompts(), expected[0]))[:3]:     # and one stage is right
        assert tokens == hf_greedy(path, prompt, PARAMS.max_tokens)
    for sizes in (dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=3),
                  dict(tensor_parallel_size=2, pipeline_parallel_size=2)):
        got, pp_preemptions = generate_twice(path, **sizes)
        assert pp_preemptions > 0, sizes
        for run in range(2):
            assert_same(got[run], expected[run], 2e-4)
        assert not mp.active_children()


def assert_recovers_with_steps_in_flight(llm: LLM, expected: list[list[int]]) -> None:
    """Ctrl-C between steps with both stages busy: the steps in flight are dropped and the ranks stay
    in step (no restart); an error in rank 0's stage after the others got the step: they start anew;
    a real SIGINT wherever it lands. Each time the engine ends consistent and right."""
    core = llm.engine.core

    def generate_correctly():
        assert_consistent(llm)
        assert llm.engine.is_finished() and core.scheduler.block_manager.num_used_blocks == 0
        assert [o["token_ids"] for o in llm.generate(prompts(), PARAMS, use_tqdm=False)] == expected

    schedule, executor = core.scheduler.schedule, core.executor

    def ctrl_c_with_both_stages_busy(busy=frozenset()):
        if len(core.in_flight) == 2:
            core.scheduler.schedule = schedule
            raise KeyboardInterrupt
        return schedule(busy)
    core.scheduler.schedule = ctrl_c_with_both_stages_busy
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts(), PARAMS, use_tqdm=False)
    assert core.executor is executor and not executor.incoming
    generate_correctly()

    pids = [process.process.pid for process in executor.processes]
    fail_on_call(executor.driver, "execute", 6, Injected)
    try:
        with pytest.raises(Injected):
            llm.generate(prompts(), PARAMS, use_tqdm=False)
    finally:
        restore(executor.driver, "execute")
    assert core.executor is not executor
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    generate_correctly()

    generate_until_ctrl_c(llm, prompts(), PARAMS, 0.3)
    generate_correctly()


def test_three_stages_uneven_split_and_a_dead_stage(five_layers_untied, hf_greedy, oversubscribe):
    with LLM(five_layers_untied, **TIGHT) as llm:
        expected = run_workload(llm)
    llm = LLM(five_layers_untied, **TIGHT, pipeline_parallel_size=3)
    executor = llm.engine.core.executor
    assert (executor.driver.model.start_layer, len(executor.driver.attention_layers)) == (0, 2)
    assert executor.driver.kv_cache.tensor.shape[1] == 2       # the pool holds this stage's layers only
    got = run_workload(llm)
    assert got["max_in_flight"] == 3 and got["taken_from_oldest"] > 50
    assert_same_workload(got, expected, 1e-4)
    for prompt, (tokens, _) in list(zip(prompts(), expected["greedy"][0]))[:2]:
        assert tokens == hf_greedy(five_layers_untied, prompt, PARAMS.max_tokens)

    # rank 1, the middle stage, dies in the middle of a generate: after the step's inputs went out and
    # while rank 0 runs its own share, so rank 0 meets the death inside the step's send/recv
    stage, execute, calls = executor.processes[0].process, executor.driver.execute, []

    def execute_after_killing_the_middle_stage(inputs, **kwargs):
        calls.append(inputs)
        if len(calls) == 20:
            stage.kill()
            stage.join()
        return execute(inputs, **kwargs)

    executor.driver.execute = execute_after_killing_the_middle_stage
    pids = [p.process.pid for p in executor.processes]
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pipeline stage 1, tensor-parallel rank 0\) died"):
            llm.generate([[5] * 50] * 8, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
                         use_tqdm=False)
        assert len(calls) >= 20 and time.monotonic() - start < 60     # the process group would wait 10 minutes
    finally:
        llm.shutdown()
    assert not mp.active_children()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_send_to_a_stage_that_just_died_never_returning_is_an_error(four_layers, monkeypatch):
    """gloo's send to a rank that has just died can miss the closed connection and wait out the
    process group's timeout (10 minutes; seen about once in 90 kills), so rank 0's share of the step
    never returns: the executor watches the ranks meanwhile and names the dead one."""
    import nanovllm.worker.worker as worker_module
    llm = LLM(four_layers, kvcache_block_size=16, max_model_len=256, pipeline_parallel_size=2)
    stage, release = llm.engine.core.executor.processes[0].process, threading.Event()

    def send_that_never_returns(*args):
        stage.kill()
        stage.join()
        release.wait()
        raise ConnectionError("released at the end of the test")

    monkeypatch.setattr(worker_module, "send_activations", send_that_never_returns)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pipeline stage 1, tensor-parallel rank 0\) died"):
            llm.generate([[5] * 20], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        release.set()
        llm.shutdown()
    assert not mp.active_children()


def test_two_stages_of_two_tensor_parallel_ranks(four_layers, one_stage, oversubscribe):
    with LLM(four_layers, **TIGHT, tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        got = run_workload(llm)
    # the first stage's second rank gets the ids its pending tokens read from rank 0
    assert got["max_in_flight"] == 2 and got["taken_from_oldest"] > 50
    assert_same_workload(got, one_stage, 2e-4)    # tensor parallelism sums in another order
    assert not mp.active_children()


@pytest.mark.parametrize("engine_args, message", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
    (dict(pipeline_parallel_size=5), "pipeline_parallel_size=5 is more than the model's 4 layers"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), "pipeline_parallel_size=2 = 4 ranks"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config"),
    (dict(pipeline_parallel_size=2, runner="pooling"), "runner='pooling' runs on one pipeline stage"),
])
def test_bad_sizes(four_layers, engine_args, message, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match=message):
        Config(four_layers, **engine_args)
    with pytest.raises(ValueError, match=message):     # and the engine starts no process
        LLM(four_layers, **engine_args)
    assert not mp.active_children()
