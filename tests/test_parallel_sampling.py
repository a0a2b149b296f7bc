"""n completions per prompt over shared prompt blocks, and beam search, against independent
references: transformers' float32 log-softmax for beams, plain greedy for n greedy copies."""
import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, BeamSearchParams, SamplingParams
from tests.conftest import mixed_prompts

PROMPTS = mixed_prompts(500, lengths=(21, 7, 40, 1), seed=21)


@pytest.fixture(scope="module")
def llm(model_paths):
    return LLM(model_paths["gqa_tied"], kvcache_block_size=16)


# ---- n > 1 -------------------------------------------------------------------------------------

def seeded(n, seed=7, **kwargs):
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True, **kwargs)


def completions(output) -> list[list[int]]:
    return [c["token_ids"] for c in output["outputs"]]


def test_n_greedy_copies_equal_greedy(llm, hf_greedy):
    outputs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_greedy(llm.config.model, prompt, 10)
        assert completions(out) == [expected] * 3 and out["token_ids"] == expected
        assert [c["index"] for c in out["outputs"]] == [0, 1, 2]
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_seeded_n_is_reproducible_and_siblings_differ(llm):
    first = llm.generate(PROMPTS[:2], seeded(4), use_tqdm=False)
    others = mixed_prompts(500, lengths=(9, 30), seed=3)
    second = llm.generate(others + PROMPTS[:2][::-1], [seeded(2, seed=1)] * 2 + [seeded(4)] * 2,
                          use_tqdm=False)[2:][::-1]
    assert [completions(o) for o in first] == [completions(o) for o in second]
    for out in first:
        assert len({tuple(c) for c in completions(out)}) == 4          # different streams
    # completion i's stream is (seed, i): the first of n equals the request with n = 1
    assert llm.generate(PROMPTS[:1], seeded(1), use_tqdm=False)[0]["token_ids"] == completions(first[0])[0]


def test_prompt_blocks_are_held_once_while_the_n_sequences_run(llm):
    prompt = mixed_prompts(500, lengths=(53,), seed=8)[0]          # 3 full blocks of 16 + 5 tokens
    bm = llm.engine.core.scheduler.block_manager
    request_id = llm.engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=20,
                                                        ignore_eos=True))
    for _ in range(4):
        llm.engine.step()
    group = llm.engine.core.requests[request_id].group
    assert len(group) == 4
    tables = [seq.block_table for seq in group]
    assert all(table[:3] == tables[0][:3] for table in tables)            # full prompt blocks shared
    assert all(bm.blocks[b].ref_count == 4 for b in tables[0][:3])
    assert len({table[3] for table in tables}) == 4                        # the partial block copied
    assert bm.num_used_blocks == 3 + 4
    while not llm.engine.is_finished():
        llm.engine.step()
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)


def test_forked_kv_is_right_after_copy_on_write(llm, hf_greedy):
    """The copied partial block carries the prompt's K/V: greedy copies continuing it equal greedy
    (a missed copy would read zeros for the prompt tail)."""
    prompt = mixed_prompts(500, lengths=(37,), seed=9)[0]
    out = llm.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert completions(out) == [hf_greedy(llm.config.model, prompt, 12)] * 2


def test_abort_frees_every_sequence_of_the_request(llm):
    request_id = llm.engine.add_request(PROMPTS[2], SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        llm.engine.step()
    assert len(llm.engine.core.requests[request_id].group) == 3 and llm.engine.core.scheduler.block_manager.num_used_blocks > 0
    assert llm.engine.abort(request_id)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    while not llm.engine.is_finished():
        assert llm.engine.step() == []


def test_n_under_preemption_pressure(model_paths):
    path = model_paths["gqa_tied"]
    prompts = mixed_prompts(500, lengths=(30, 45, 20), seed=4)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    roomy = LLM(path, kvcache_block_size=16).generate(prompts, params, use_tqdm=False)
    tight = LLM(path, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [completions(o) for o in squeezed] == [completions(o) for o in roomy]
    assert tight.engine.core.scheduler.block_manager.num_used_blocks == 0


# ---- beam search -------------------------------------------------------------------------------

def reference_beam_search(model, prompt, width, max_tokens, eos_ids, ignore_eos, length_penalty):
    """The algorithm as SPEC.md states it, over transformers' float32 log-softmax (full recompute)."""
    live = [([], 0.0)]
    finished = []
    for step in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for lp, token in zip(top.values.tolist(), top.indices.tolist()):
                if token in eos_ids and not ignore_eos:
                    finished.append((tokens + [token], cum + lp))
                else:
                    candidates.append((tokens + [token], cum + lp))
        live = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]
    finished += live

    def score(beam):
        tokens, cum = beam
        length = len(prompt) + len(tokens) - (1 if tokens and tokens[-1] in eos_ids else 0)
        return cum / length ** length_penalty
    return sorted(finished, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def eos_beam_model(model_paths, tmp_path_factory):
    """A copy of the tiny model whose EOS is a token that often ranks high, so beams end early."""
    path = str(tmp_path_factory.mktemp("eos_beams"))
    shutil.copytree(model_paths["gqa_tied"], path, dirs_exist_ok=True)
    greedy = LLM(path, kvcache_block_size=16).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    eos = greedy[0]["token_ids"][2]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, eos]}, f)
    return path, (2, eos)


@pytest.mark.parametrize("width", [1, 3, 4])
@pytest.mark.parametrize("with_eos", [False, True])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_equals_the_reference(model_paths, eos_beam_model, hf_model_cache, hf_greedy, width, with_eos,
                                          length_penalty):
    path, eos_ids = eos_beam_model
    hf_greedy(model_paths["gqa_tied"], [5], 1)               # loads the transformers model (same weights)
    model = hf_model_cache[model_paths["gqa_tied"]]
    beams = LLM(path, kvcache_block_size=16)
    prompts = PROMPTS[:3]
    params = BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=not with_eos, length_penalty=length_penalty)
    outputs = beams.beam_search(prompts, params)
    reasons = []
    for prompt, out in zip(prompts, outputs):
        expected = reference_beam_search(model, prompt, width, 8, eos_ids, not with_eos, length_penalty)
        assert [s["token_ids"] for s in out["sequences"]] == [tokens for tokens, _ in expected]
        for got, (_, cum) in zip(out["sequences"], expected):
            assert got["cum_logprob"] == pytest.approx(cum, abs=1e-3)
            assert got["text"] == beams.tokenizer.decode(got["token_ids"], skip_special_tokens=True)
        reasons += [s["finish_reason"] for s in out["sequences"]]
    if with_eos and width > 1:
        assert "stop" in reasons                              # EOS endings were exercised
    if width == 1 and not with_eos:
        assert [o["sequences"][0]["token_ids"] for o in outputs] == [hf_greedy(path, p, 8) for p in prompts]
    assert beams.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_beam_search_under_preemption_pressure(model_paths):
    path = model_paths["gqa_tied"]
    prompts = mixed_prompts(500, lengths=(30, 45, 20), seed=4)
    params = BeamSearchParams(beam_width=3, max_tokens=16)
    roomy = LLM(path, kvcache_block_size=16).beam_search(prompts, params)
    tight = LLM(path, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128)
    squeezed = tight.beam_search(prompts, params)
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [[s["token_ids"] for s in o["sequences"]] for o in squeezed] == \
        [[s["token_ids"] for s in o["sequences"]] for o in roomy]
    assert tight.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_beam_search_params_are_checked(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS[:1], SamplingParams())
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
