"""The CUDA path against the CPU path and transformers; skipped without a GPU.
(On a GPU machine the rest of the suite also runs on CUDA, since device="auto" picks it.)"""
import gc
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from tests.conftest import mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def generate_and_free(path, prompts, params, **engine_args):
    llm = LLM(path, kvcache_block_size=16, **engine_args)
    outputs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.scheduler.num_preemptions
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outputs, stats


@pytest.mark.parametrize("engine_args", [
    dict(),                                                         # CUDA graphs
    dict(enforce_eager=True),
    dict(max_num_batched_tokens=24, max_num_seqs=4),                # chunked prefill
    dict(num_kvcache_blocks=8, max_model_len=128),                  # preemption
], ids=["graphs", "eager", "chunked", "preempted"])
def test_tiny_models_same_tokens_on_cuda_cpu_and_transformers(model_path, hf_greedy, engine_args):
    prompts = mixed_prompts(500, lengths=(30, 45, 20, 38, 50, 9, 1, 64))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    on_cuda, preemptions = generate_and_free(model_path, prompts, params, device="cuda", **engine_args)
    on_cpu, _ = generate_and_free(model_path, prompts, params, device="cpu", **engine_args)
    assert on_cuda == on_cpu
    assert on_cuda == [hf_greedy(model_path, p, 24) for p in prompts]
    if "num_kvcache_blocks" in engine_args:
        assert preemptions > 0


def test_prefix_cache_hits_on_cuda(model_path, hf_greedy):
    llm = LLM(model_path, device="cuda", kvcache_block_size=16)
    shared = mixed_prompts(500, lengths=(70,), seed=1)[0]
    prompts = [shared + tail for tail in mixed_prompts(500, lengths=(1, 5, 26), seed=2)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert all(o["num_cached_tokens"] >= 64 for o in second)
    assert [o["token_ids"] for o in second] == [hf_greedy(model_path, p, 16) for p in prompts]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def qwen3_06b_path():
    from nanovllm.utils.random_checkpoint import cached_random_checkpoint
    return cached_random_checkpoint(os.path.join(CONFIGS, "qwen3-0.6b.json"))


def test_qwen3_06b_shape_bf16_logits_within_bf16_tolerance(qwen3_06b_path):
    """First-step (prefill) and second-step (decode, CUDA graph) logits against transformers on the
    same weights. The bar is transformers' own bf16 error against its float32 run."""
    from transformers import AutoModelForCausalLM
    llm = LLM(qwen3_06b_path, gpu_memory_utilization=0.4)
    assert llm.config.torch_dtype == torch.bfloat16
    prompts = mixed_prompts(10000, lengths=(1, 17, 300, 1000), seed=4)
    seqs = [Sequence(p, SamplingParams(temperature=0)) for p in prompts]
    for seq in seqs:
        llm.scheduler.add(seq)
    runner = llm.model_runner
    prefill = llm.scheduler.schedule()
    assert prefill.is_prefill and len(prefill.seqs) == len(prompts)
    prefill_logits = runner.execute(runner.prepare_step(prefill))
    next_tokens = prefill_logits.argmax(-1).tolist()
    llm.scheduler.fill(llm.scheduler.advance(prefill), next_tokens)   # every prompt completes: one token each
    decode = llm.scheduler.schedule()
    assert not decode.is_prefill and runner.graphs
    decode_inputs = runner.prepare_step(decode)
    decode_logits = runner.execute(decode_inputs)
    graphs, runner.graphs = runner.graphs, None
    eager_logits = runner.execute(decode_inputs)      # same step without the CUDA graph
    runner.graphs = graphs
    assert relative_error(decode_logits, eager_logits) < 1e-2

    hf_bf16 = AutoModelForCausalLM.from_pretrained(qwen3_06b_path, dtype=torch.bfloat16).cuda().eval()
    hf_fp32 = AutoModelForCausalLM.from_pretrained(qwen3_06b_path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        for i, (prompt, token) in enumerate(zip(prompts, next_tokens)):
            for ours, ids in ((prefill_logits[i], prompt), (decode_logits[i], prompt + [token])):
                x = torch.tensor([ids], device="cuda")
                ref = hf_fp32(x).logits[0, -1]
                hf_error = relative_error(hf_bf16(x).logits[0, -1], ref)
                our_error = relative_error(ours, ref)
                print(f"prompt {len(prompt):4d} tokens, step {len(ids) - len(prompt) + 1}: "
                      f"ours {our_error:.4f}, transformers bf16 {hf_error:.4f} (relative to float32)")
                assert our_error < max(2 * hf_error, 1e-2)
