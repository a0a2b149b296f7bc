"""What works on one stage keeps working on two (CPU, gloo), each judged against a one-stage engine
on the same weights: n > 1, beam search, structured outputs, prompt logprobs and an abort in one
engine; FP8 KV with FP8 weights, and AWQ weights; interrupted steps and Ctrl-C; the server."""
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from nanovllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from nanovllm.checkpoints.quantized_checkpoint import write_awq_checkpoint
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from tests.conftest import alive, child_pids, mixed_prompts

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or (os.cpu_count() or 1) < 2,
                                reason="gloo stages on a CPU with 2+ cores")

TWO_STAGES = dict(pipeline_parallel_size=2)
PROMPTS = mixed_prompts(500, lengths=(30, 3, 21, 45), seed=12)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
# chunked prefill (32 tokens a step) and a pool too small for every prompt at once (preemption)
TIGHT = dict(kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8,
             num_kvcache_blocks=8)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("pp_features")), seed=4, num_hidden_layers=4)


def assert_close(got, expected, tolerance: float = 2e-4, where: str = "") -> None:
    """Equal, except floats (logprobs), which agree to `tolerance`: stages run their layers in other
    processes, with other thread counts, so float32 sums may round differently."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, abs=tolerance), where
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_close(got[key], expected[key], tolerance, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_close(a, b, tolerance, f"{where}[{i}]")
    else:
        assert got == expected, where


# ---- sampling features, in one engine each ------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "e": {"enum": ["ab", "cd"]}}, "required": ["n", "e"]}


def run_features(llm: LLM) -> dict:
    """Outputs of each feature, as plain values to compare; the sampling ones in one batch."""
    seeded_n = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    structured = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                  StructuredOutputsParams(regex=r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"),
                  StructuredOutputsParams(choice=["yes", "no", "maybe"])]
    params = [seeded_n, seeded_n] + [SamplingParams(temperature=0.7, seed=i, max_tokens=60, structured_outputs=s)
                                     for i, s in enumerate(structured)] + \
        [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    results = {"n": [[(c["token_ids"], c["logprobs"]) for c in o["outputs"]] for o in outputs[:2]],
               "structured": [(o["text"], o["finish_reason"]) for o in outputs[2:5]],
               "prompt_logprobs": outputs[5]["prompt_logprobs"]}
    beams = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=8))
    results["beams"] = [[(s["token_ids"], s["cum_logprob"]) for s in o["sequences"]] for o in beams]

    # an abort in the middle: its blocks come back at once, the others finish as they would
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    used = engine.core.scheduler.block_manager.num_used_blocks
    assert engine.abort(ids[0]) and engine.core.scheduler.block_manager.num_used_blocks < used
    finished = {}
    while not engine.is_finished():
        finished.update((o["request_id"], (o["token_ids"], o["logprobs"])) for o in engine.step())
    assert set(finished) == set(ids[1:]) and engine.core.scheduler.block_manager.num_used_blocks == 0
    results["after_abort"] = [finished[i] for i in ids[1:]]
    return results


def test_sampling_features_match_one_stage(four_layers):
    pytest.importorskip("xgrammar")
    args = dict(kvcache_block_size=16, max_model_len=256)
    with LLM(four_layers, **args) as llm:
        expected = run_features(llm)
    with LLM(four_layers, **args, **TWO_STAGES) as llm:
        got = run_features(llm)
    for feature in expected:
        assert_close(got[feature], expected[feature], where=feature)
    assert all(reason == "stop" for _, reason in expected["structured"])     # each grammar ended
    assert not mp.active_children()


# ---- FP8 KV and quantized weights -----------------------------------------------------------------

def generate_twice(path: str, **engine_args) -> list:
    """Greedy tokens and logprobs of two identical calls (the second hits the prefix cache)."""
    with LLM(path, device="cpu", **TIGHT, **engine_args) as llm:
        runs = [llm.generate(PROMPTS, GREEDY, use_tqdm=False) for _ in range(2)]
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert runs[1][0]["num_cached_tokens"] >= 16
    return [[(o["token_ids"], o["logprobs"]) for o in run] for run in runs]


def test_fp8_kv_with_fp8_weights_and_awq_weights_match_one_stage(four_layers, tmp_path):
    """Each stage calibrates the float8 scales of its own layers from the same prefill. Equal to the
    bit on this machine; the tolerances leave room for a float8 or float16 rounding that thread counts
    move elsewhere."""
    fp8 = dict(kv_cache_dtype="fp8", quantization="fp8")
    assert_close(generate_twice(four_layers, **fp8, **TWO_STAGES), generate_twice(four_layers, **fp8), 1e-3)
    awq = write_awq_checkpoint(four_layers, str(tmp_path / "awq"), group_size=32)    # float16 beside the 4 bits
    assert_close(generate_twice(awq, **TWO_STAGES), generate_twice(awq), 1e-2)
    assert not mp.active_children()


# ---- interruptions --------------------------------------------------------------------------------

def test_interrupts_and_ctrl_c_under_two_stages(four_layers):
    """Each point of the loop interrupted: the engine ends consistent and the next call's tokens
    equal one stage's. A failure in rank 0's share of a step, after stage 1 got it, restarts the
    stages (rank 0's own layers fail here); elsewhere the stages keep running."""
    from tests.test_interrupts import assert_consistent, generate_until_ctrl_c, interrupt_each_point_with_ranks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["never appears\x00"])
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(four_layers, kvcache_block_size=16) as llm:
        expected = [o["token_ids"] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    with LLM(four_layers, kvcache_block_size=16, **TWO_STAGES) as llm:
        interrupt_each_point_with_ranks(llm, PROMPTS, params, greedy, expected)
        # a real Ctrl-C, wherever it lands
        generate_until_ctrl_c(llm, PROMPTS * 4, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), 0.3)
        assert_consistent(llm)
        assert [o["token_ids"] for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == expected
    assert not mp.active_children()


# ---- the server -----------------------------------------------------------------------------------

def test_server_of_two_stages_answers_as_one_stage_and_sigterm_stops_them(four_layers):
    import openai
    from tests.test_serve import free_port, start_server, stream_then_signal, wait_ready
    prompt = "The scheduler decides"
    with LLM(four_layers, kvcache_block_size=16, max_model_len=512) as llm:
        expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
                                use_tqdm=False)[0]
    port = free_port()
    server = start_server(four_layers, port, "--device", "cpu", "--pipeline-parallel-size", "2",
                          "--max-model-len", "512", "--kvcache-block-size", "16")
    try:
        wait_ready(server, port)
        stages = child_pids(server.pid)
        assert stages, "a server of two stages has a worker process"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        choice = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=16,
                                           temperature=0, logprobs=2, extra_body={"ignore_eos": True}).choices[0]
        assert choice.text == expected["text"]
        chosen = [entry[token] for token, entry in zip(expected["token_ids"], expected["logprobs"])]
        assert choice.logprobs.token_logprobs == pytest.approx(chosen, abs=2e-4)
        stream_then_signal(f"http://127.0.0.1:{port}", server, signal.SIGTERM, max_tokens=480)
        time.sleep(0.2)
        assert not [pid for pid in stages if alive(pid)]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
