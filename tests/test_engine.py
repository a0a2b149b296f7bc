"""The whole engine on the CPU, judged token for token against a plain transformers greedy loop."""
import json
import os
import shutil

import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def vocab_size(llm: LLM) -> int:
    return llm.config.hf_config.vocab_size


def assert_matches_transformers(llm, outputs, prompts, hf_greedy, num_tokens=16):
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(llm.config.model, prompt, num_tokens), f"prompt of {len(prompt)} tokens"


def test_cpu_path_defaults_to_float32(model_path):
    llm = LLM(model_path, device="cpu")
    assert llm.config.device == "cpu" and str(llm.config.torch_dtype) == "torch.float32"
    assert llm.engine.core.executor.driver.kv_cache.dtype == llm.config.torch_dtype


def test_mixed_batch_matches_transformers(model_path, hf_greedy):
    llm = LLM(model_path, kvcache_block_size=16)
    prompts = mixed_prompts(vocab_size(llm))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [16] * len(prompts)
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert_matches_transformers(llm, outputs, prompts, hf_greedy)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_keep_tokens(model_path, hf_greedy):
    llm = LLM(model_path, kvcache_block_size=16)
    shared = mixed_prompts(vocab_size(llm), lengths=(70,), seed=1)[0]
    tails = mixed_prompts(vocab_size(llm), lengths=(1, 5, 16, 26), seed=2)   # 70 + 26 = 6 full blocks
    prompts = [shared + tail for tail in tails]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    # 70 shared tokens = 4 full blocks of 16; the second call also finds each prompt's own blocks
    assert all(o["num_cached_tokens"] >= 64 for o in second)
    assert all(o["num_cached_tokens"] % 16 == 0 and o["num_cached_tokens"] < len(p) for o, p in zip(second, prompts))
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    assert_matches_transformers(llm, second, prompts, hf_greedy)


def test_prefix_cache_off_reports_no_hits(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16, enable_prefix_caching=False)
    prompt = mixed_prompts(vocab_size(llm), lengths=(50,))[0]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 0


def test_chunked_prefill_keeps_tokens(model_path, hf_greedy):
    llm = LLM(model_path, kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    steps = []
    schedule = llm.engine.core.scheduler.schedule

    def recording_schedule(*args):
        batch = schedule(*args)
        steps.append((batch.is_prefill, list(zip([s.seq_id for s in batch.seqs], batch.num_new_tokens))))
        return batch

    llm.engine.core.scheduler.schedule = recording_schedule
    prompts = mixed_prompts(vocab_size(llm), lengths=(100, 3, 60, 25, 1, 40))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_transformers(llm, outputs, prompts, hf_greedy)
    chunks_of_longest = [n for is_prefill, work in steps if is_prefill for sid, n in work
                         if sid == outputs[0]["request_id"]]
    assert len(chunks_of_longest) >= 5 and sum(chunks_of_longest) == 100
    assert all(sum(n for _, n in work) <= 24 and len(work) <= 4 for _, work in steps)


def test_preemption_keeps_tokens(model_path, hf_greedy):
    # 8 blocks of 16 tokens hold one sequence of max_model_len=128, not all of these at once
    llm = LLM(model_path, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128)
    prompts = mixed_prompts(vocab_size(llm), lengths=(30, 45, 20, 38, 50, 9), seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_matches_transformers(llm, outputs, prompts, hf_greedy, num_tokens=24)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_outputs_in_prompt_order_with_metrics(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompts = ["Introduce yourself", "List all prime numbers within 100", "Hi"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [3, 9, 5]
    for prompt, out in zip(prompts, outputs):
        assert out["prompt_token_ids"] == llm.tokenizer.encode(prompt)
        assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
        metrics = out["metrics"]
        assert 0 < metrics["time_to_first_token"] <= metrics["latency"]
        assert metrics["time_per_output_token"] >= 0


def test_engine_driven_step_by_step(model_paths, hf_greedy):
    llm = LLM(model_paths["mha_untied"], kvcache_block_size=16)
    prompts = mixed_prompts(vocab_size(llm), lengths=(12, 30))
    ids = [llm.engine.add_request(p, GREEDY) for p in prompts]
    finished = {}
    while not llm.engine.is_finished():
        for out in llm.engine.step():
            finished[out["request_id"]] = out
    assert sorted(finished) == sorted(ids)
    for request_id, prompt in zip(ids, prompts):
        assert finished[request_id]["token_ids"] == hf_greedy(llm.config.model, prompt, 16)


def test_next_step_is_launched_before_the_tokens_of_the_last_arrive(model_paths, hf_greedy):
    """The host queues step N+1 while step N runs: N+1 reads N's tokens on the device, from
    pending rows that stand in the sequences until N's tokens are collected."""
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompts = mixed_prompts(vocab_size(llm), lengths=(12, 30, 5))
    for p in prompts:
        llm.engine.add_request(p, GREEDY)
    llm.engine.step()                                              # prefill: launched, not collected
    assert llm.engine.core.in_flight
    assert all(seq.pending_row is not None and seq.num_tokens == len(seq.token_ids) + 1 == seq.num_prompt_tokens + 1
               for seq in llm.engine.core.scheduler.running)
    llm.engine.step()                                              # decode launched from those pending rows
    assert all(seq.pending_row is not None and seq.num_completion_tokens == 2 and len(seq.completion_token_ids) == 1
               for seq in llm.engine.core.scheduler.running)
    finished = []
    while not llm.engine.is_finished():
        finished += llm.engine.step()
    by_id = {o["request_id"]: o for o in finished}
    assert [o["token_ids"] for o in sorted(by_id.values(), key=lambda o: o["request_id"])] == \
        [hf_greedy(llm.config.model, p, 16) for p in prompts]


def test_early_stops_do_not_disturb_the_step_already_queued(model_paths, hf_greedy):
    """Sequences stopped by a token are already in the next queued step; that step's work for them
    is dropped, the others' tokens and the prefix cache are unaffected, and no block stays held."""
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompts = mixed_prompts(vocab_size(llm), lengths=(40, 3, 33, 17, 64, 9), seed=3)
    expected = [hf_greedy(llm.config.model, p, 16) for p in prompts]
    # every other request stops at its own third token; the rest run to max_tokens
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             stop_token_ids=[e[2]] if i % 2 == 0 else []) for i, e in enumerate(expected)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, e) in enumerate(zip(outputs, expected)):
        want = e[:e.index(e[2]) + 1] if i % 2 == 0 else e
        assert out["token_ids"] == want and out["finish_reason"] == ("stop" if i % 2 == 0 else "length")
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    again = llm.generate(prompts, GREEDY, use_tqdm=False)     # served from the cache they left
    assert sum(o["num_cached_tokens"] for o in again) > 0
    assert [o["token_ids"] for o in again] == expected


def test_logprobs_match_transformers(model_paths, hf_model_cache, hf_greedy):
    import torch
    path = model_paths["gqa_tied"]
    llm = LLM(path, kvcache_block_size=16)
    prompt = mixed_prompts(vocab_size(llm), lengths=(20,))[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    hf_greedy(path, prompt, 1)   # loads the reference model
    model = hf_model_cache[path]
    ids = list(prompt)
    for token, entry in zip(out["token_ids"], out["logprobs"]):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
        top = ref.topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(ref[token_id].item(), abs=1e-4)
        ids.append(token)


def test_seeded_sampling_is_reproducible(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    prompt = mixed_prompts(vocab_size(llm), lengths=(10,))[0]
    params = lambda seed: SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=seed)  # noqa: E731
    other = mixed_prompts(vocab_size(llm), lengths=(5, 8))
    a = llm.generate([prompt], params(7), use_tqdm=False)[0]["token_ids"]
    b = llm.generate(other + [prompt], [params(None), params(None), params(7)], use_tqdm=False)[2]["token_ids"]
    c = llm.generate([prompt], params(8), use_tqdm=False)[0]["token_ids"]
    assert a == b   # same seed, same tokens, whatever else is in the batch
    assert a != c


# ---- stopping ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_model(model_paths, tmp_path_factory):
    """A copy of a tiny model whose generation_config names, as EOS, the token that greedy
    decoding of PROMPT produces at step EOS_STEP."""
    path = str(tmp_path_factory.mktemp("eos_model"))
    shutil.copytree(model_paths["mha_untied"], path, dirs_exist_ok=True)
    llm = LLM(path, kvcache_block_size=16)
    prompt = mixed_prompts(llm.config.hf_config.vocab_size, lengths=(12,), seed=5)[0]
    tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                          use_tqdm=False)[0]["token_ids"]
    step = next(i for i in range(4, 30) if tokens[i] not in tokens[:i])
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, tokens[step]]}, f)
    return path, prompt, tokens, step


def test_eos_stops_unless_ignored(eos_model):
    path, prompt, tokens, step = eos_model
    llm = LLM(path, kvcache_block_size=16)
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert stopped["token_ids"] == tokens[:step + 1] and stopped["finish_reason"] == "stop"
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0]
    assert ignored["token_ids"] == tokens and ignored["finish_reason"] == "length"


def test_min_tokens_forbids_early_eos(eos_model, hf_greedy):
    path, prompt, tokens, step = eos_model
    llm = LLM(path, kvcache_block_size=16)
    min_tokens = step + 3
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, min_tokens=min_tokens),
                       use_tqdm=False)[0]
    eos = tokens[step]
    assert len(out["token_ids"]) >= min_tokens
    assert eos not in out["token_ids"][:min_tokens]
    # until min_tokens the EOS ids are masked out; transformers with the same mask agrees
    expected = hf_greedy(path, prompt, min_tokens, banned=[2, eos])
    assert out["token_ids"][:min_tokens] == expected


def test_stop_token_ids(eos_model):
    path, prompt, tokens, step = eos_model
    llm = LLM(path, kvcache_block_size=16)
    stop_at = tokens[step]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out["token_ids"] == tokens[:step + 1] and out["finish_reason"] == "stop"


def test_stop_string_cuts_text(eos_model):
    path, prompt, tokens, _ = eos_model
    llm = LLM(path, kvcache_block_size=16)
    full = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = next(full[i:i + 2] for i in range(len(full) // 3, len(full)) if full[i:i + 2].strip() and
                full.find(full[i:i + 2]) == i)
    cut = full.find(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == full[:cut] and stop not in out["text"]
    assert out["token_ids"] == tokens[:len(out["token_ids"])] and len(out["token_ids"]) < len(tokens)


def test_max_tokens_is_length(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 7 and out["finish_reason"] == "length"


def test_max_model_len_is_length(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16, max_model_len=40)
    out = llm.generate([list(range(3, 33))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out["token_ids"]) == 10 and out["finish_reason"] == "length"


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make_prompt, error, words", [
    (lambda v: [], ValueError, "empty"),
    (lambda v: "", ValueError, "empty"),
    (lambda v: [5] * 64, ValueError, "max_model_len"),
    (lambda v: [5, v], ValueError, "vocabulary"),
    (lambda v: [5, -1], ValueError, "vocabulary"),
    (lambda v: [5, 6.0], TypeError, "prompt"),
    (lambda v: 17, TypeError, "prompt"),
])
def test_bad_prompt_is_rejected_and_engine_keeps_working(model_paths, hf_greedy, make_prompt, error, words):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16, max_model_len=64)
    good = [5, 6, 7, 8]
    with pytest.raises(error, match=words):
        llm.generate([good, make_prompt(vocab_size(llm))], GREEDY, use_tqdm=False)
    assert llm.engine.is_finished()   # nothing from the rejected call was queued
    assert llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(llm.config.model, good, 16)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(top_k=-3), ValueError, "top_k"),
])
def test_bad_sampling_params(kwargs, error, words):
    with pytest.raises(error, match=words):
        SamplingParams(**kwargs)


def test_bad_generate_arguments(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate([[5]], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="prompts"):
        llm.generate("one string", GREEDY, use_tqdm=False)
    assert llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0]["finish_reason"] == "length"


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(kvcache_block_size=48), ValueError, "kvcache_block_size"),
    (dict(kvcache_block_size=512), ValueError, "kvcache_block_size"),
    (dict(max_model_len=10**6), ValueError, "max_model_len"),
    (dict(num_kvcache_blocks=1, kvcache_block_size=16), ValueError, "num_kvcache_blocks"),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), ValueError, "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(dtype="float64"), ValueError, "dtype"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size"),
    (dict(enforce_eager="yes"), TypeError, "enforce_eager"),
    (dict(max_num_seqs=2.5), TypeError, "max_num_seqs"),
    (dict(no_such_argument=1), TypeError, "no_such_argument"),
    (dict(load_format="npz"), ValueError, "load_format"),
])
def test_bad_engine_arguments(model_paths, kwargs, error, words):
    with pytest.raises(error, match=words):
        LLM(model_paths["gqa_tied"], **kwargs)


def test_model_directory_without_config_or_weights(model_paths, tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(str(tmp_path / "missing"))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(model_paths["gqa_tied"], "config.json"), no_weights)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(no_weights))
    no_config = tmp_path / "no_config"
    shutil.copytree(model_paths["gqa_tied"], no_config)
    os.remove(no_config / "config.json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(no_config))


def test_dummy_weights_are_the_random_checkpoint_drawn_in_place(tmp_path):
    """load_format="dummy" needs no weight files; it draws what write_random_checkpoint would write
    (same seed), so it must generate exactly what the written checkpoint does."""
    import torch
    from nanovllm.checkpoints.random_checkpoint import tiny_config, write_demo_tokenizer, write_random_checkpoint
    written = str(tmp_path / "written")
    tokenizer = write_demo_tokenizer(written)
    device = "cuda" if torch.cuda.is_available() else "cpu"      # where the engine will draw them
    write_random_checkpoint(written, tiny_config(len(tokenizer)), dtype=torch.float32, device=device)
    shape_only = tmp_path / "shape_only"
    shutil.copytree(written, shape_only, ignore=shutil.ignore_patterns("*.safetensors"))
    prompts, params = [[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0.0, max_tokens=8)
    expected = [o["token_ids"] for o in LLM(written).generate(prompts, params, use_tqdm=False)]
    got = [o["token_ids"] for o in LLM(str(shape_only), load_format="dummy").generate(prompts, params, use_tqdm=False)]
    assert got == expected
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(shape_only))
