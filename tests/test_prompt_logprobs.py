"""SamplingParams(prompt_logprobs=k) against transformers' log-softmax of the prompt (float32, same
weights): whole and chunked prefills, n > 1, a prefix already in the prefix cache, and bad values."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.test_engine import mixed_prompts


@pytest.fixture(scope="module")
def llm(model_paths):
    # chunked prefill: prompts longer than 24 tokens take several steps
    return LLM(model_paths["gqa_tied"], kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=4,
               max_model_len=128, dtype="float32")


@pytest.fixture(scope="module")
def reference(model_paths):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_paths["gqa_tied"], dtype=torch.float32).eval()

    def prompt_log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return prompt_log_softmax


def assert_prompt_logprobs(entries, prompt, reference, k):
    assert len(entries) == len(prompt) and entries[0] is None
    ref = reference(prompt)
    for position in range(1, len(prompt)):
        entry, row = entries[position], ref[position - 1]
        top = row.topk(k).indices.tolist() if k else []
        assert list(entry)[0] == prompt[position]          # the prompt token first, as vLLM
        assert set(entry) == set(top) | {prompt[position]}
        for token_id, logprob in entry.items():
            assert logprob == pytest.approx(row[token_id].item(), abs=1e-4)


def vocab(llm):
    return llm.config.hf_config.vocab_size


def test_prompt_logprobs_match_transformers_with_chunked_prefill(llm, reference):
    prompts = mixed_prompts(vocab(llm), lengths=(7, 50, 1, 30), seed=11)
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k) for k in (2, 0, 1, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, p in zip(outs, prompts, params):
        assert_prompt_logprobs(out["prompt_logprobs"], prompt, reference, p.prompt_logprobs)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_sequences_without_prompt_logprobs_get_none(llm):
    prompt = mixed_prompts(vocab(llm), lengths=(20,), seed=3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out["prompt_logprobs"] is None


def test_prompt_logprobs_with_n_and_a_cached_prefix(llm, reference):
    prompt = mixed_prompts(vocab(llm), lengths=(40,), seed=21)[0]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)   # leaves it cached
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert again["num_cached_tokens"] > 0
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 0            # recomputed, as vLLM does
    assert len(out["outputs"]) == 3
    assert_prompt_logprobs(out["prompt_logprobs"], prompt, reference, 3)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("value, error", [(-1, ValueError), (21, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_prompt_logprobs_name_the_argument(llm, value, error):
    with pytest.raises(error, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
    params = SamplingParams()
    params.prompt_logprobs = value
    with pytest.raises(error, match="prompt_logprobs"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)[0]["token_ids"]
