"""The CUDA path against the CPU path and transformers; skipped without a GPU.
(On a GPU machine the rest of the suite also runs on CUDA, since device="auto" picks it.)"""
import gc
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import Sequence
from tests.conftest import mixed_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def generate_and_free(path, prompts, params, **engine_args):
    llm = LLM(path, kvcache_block_size=16, **engine_args)
    outputs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.core.scheduler.num_preemptions
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


def compiled_variants(kernel) -> int:
    """How many specialisations of a Triton kernel this process has compiled, on every device."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_requests_after_start_up_compile_no_kernel(model_path):
    """Start-up compiles what serving needs: prefills with and without cached context (prefix-cache
    hits, chunked prompts, block tables 1 to 20 blocks wide, step inputs of every size) and decodes
    (CUDA graphs) compile no Triton kernel afterwards. A compile in the middle of serving stalls
    every running request for a second or more."""
    from nanovllm.kernels import paged_attention, rms_norm, rotary_embedding, sampling, silu_and_mul

    kernels = {"prefill": paged_attention._prefill_kernel, "decode": paged_attention._decode_kernel,
               "rotary": rotary_embedding._rotary_kernel,
               "rms_norm": rms_norm._rms_norm_kernel, "silu_and_mul": silu_and_mul._silu_and_mul_kernel,
               "chunk_summary": sampling._chunk_summary_kernel, "pick_token": sampling._pick_token_kernel}
    llm = LLM(model_path, device="cuda", kvcache_block_size=16, max_num_batched_tokens=64, max_num_seqs=4)
    before = {name: compiled_variants(kernel) for name, kernel in kernels.items()}
    shared = mixed_prompts(500, lengths=(40,), seed=3)[0]
    prompts = [shared + tail for tail in mixed_prompts(500, lengths=(3, 200, 290), seed=4)]   # up to 20 blocks
    for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o["num_cached_tokens"] >= 32 for o in outputs)     # the second round hit the prefix cache
    assert {name: compiled_variants(kernel) for name, kernel in kernels.items()} == before
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "llama-3.1-8b"])
def test_shape_bf16_logits_within_bf16_tolerance(shape):
    """First-step (prefill) and second-step (decode, CUDA graph) logits against transformers on the
    same random weights of a full-size shape. The bar is transformers' own bf16 error against its
    float32 run. (The transformers models are loaded one at a time: the 8B shape is 16 GB in bf16.)"""
    from transformers import AutoModelForCausalLM

    from nanovllm.checkpoints.random_checkpoint import cached_random_checkpoint
    path = cached_random_checkpoint(os.path.join(CONFIGS, f"{shape}.json"))
    llm = LLM(path, gpu_memory_utilization=0.3, max_num_seqs=16)
    assert llm.config.torch_dtype == torch.bfloat16
    prompts = mixed_prompts(10000, lengths=(1, 17, 300, 1000), seed=4)
    seqs = [Sequence(p, SamplingParams(temperature=0)) for p in prompts]
    for seq in seqs:
        llm.engine.core.scheduler.add(seq)
    runner = llm.engine.core.executor
    prefill = llm.engine.core.scheduler.schedule()
    assert prefill.is_prefill and len(prefill.seqs) == len(prompts)
    prefill_logits = runner.driver.execute(runner.prepare_step(prefill)).float()
    next_tokens = prefill_logits.argmax(-1).tolist()
    llm.engine.core.scheduler.fill(llm.engine.core.scheduler.advance(prefill), next_tokens)   # every prompt completes: one token each
    decode = llm.engine.core.scheduler.schedule()
    assert not decode.is_prefill and runner.driver.graphs
    decode_inputs = runner.prepare_step(decode)
    decode_logits = runner.driver.execute(decode_inputs).float()
    graphs, runner.driver.graphs = runner.driver.graphs, []
    eager_logits = runner.driver.execute(decode_inputs).float()      # same step without the CUDA graph
    runner.driver.graphs = graphs
    assert relative_error(decode_logits, eager_logits) < 1e-2
    llm.shutdown()
    del llm, runner, graphs
    gc.collect()
    torch.cuda.empty_cache()

    cases = [(prefill_logits[i], prompt) for i, prompt in enumerate(prompts)]
    cases += [(decode_logits[i], prompt + [token]) for i, (prompt, token) in enumerate(zip(prompts, next_tokens))]
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
        with torch.no_grad():
            refs[dtype] = [hf(torch.tensor([ids], device="cuda")).logits[0, -1].float() for _, ids in cases]
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    for (ours, ids), ref, hf_bf16 in zip(cases, refs[torch.float32], refs[torch.bfloat16]):
        hf_error = relative_error(hf_bf16, ref)
        our_error = relative_error(ours, ref)
        print(f"{shape}: {len(ids):4d} tokens: ours {our_error:.4f}, transformers bf16 {hf_error:.4f} "
              f"(relative to float32)")
        assert our_error < max(2 * hf_error, 1e-2)


def test_verify_step_graphs_give_the_eager_logits(model_path):
    """A verify-sized step (1 to k + 1 tokens per sequence over cached blocks) replayed from the
    CUDA graph of k + 1 tokens, padded, against the same step run eagerly."""
    import numpy as np

    from nanovllm.executor.step_inputs import StepInputs
    llm = LLM(model_path, device="cuda", kvcache_block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    runner = llm.engine.core.executor
    assert [graphs.query_len for graphs in runner.driver.graphs] == [1, 5]
    rng = np.random.default_rng(0)
    vocab = llm.config.model_config.vocab_size
    cached, q_lens = np.array([30, 17, 45]), np.array([1, 3, 5])
    tables = np.arange(3 * 4).reshape(3, 4)          # 64 slots a sequence, 16-token blocks

    def step(starts, lens):
        cu = np.concatenate([[0], np.cumsum(lens)])
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lens)])
        seq_of_token = np.repeat(np.arange(3), lens)
        slots = tables[seq_of_token, positions // 16] * 16 + positions % 16
        return StepInputs(True, rng.integers(0, vocab, cu[-1]), positions, slots, starts + lens, cu, tables,
                          np.arange(cu[-1]))

    runner.driver.execute(step(np.zeros(3, np.int64), cached))            # the cached context, eagerly
    verify = step(cached, q_lens)
    assert runner.driver.graphs[1].size_for(verify) == 4 and runner.driver.graphs[0].size_for(verify) == 0
    replayed = runner.driver.execute(verify).float()
    graphs, runner.driver.graphs = runner.driver.graphs, []
    eager = runner.driver.execute(verify).float()
    runner.driver.graphs = graphs
    assert replayed.shape == (q_lens.sum(), vocab)
    assert relative_error(replayed, eager) < 1e-3
    llm.shutdown()


def test_awq_decode_leaves_split_sums_to_the_residual_norms(tmp_path, monkeypatch):
    """A 4-bit model in bfloat16 on CUDA: o_proj and down_proj hand their split-K sums to the next
    residual RMSNorm (PendingSums) at decode, eager and in CUDA graphs, and the tokens are those of
    the same engine with every GEMV finishing its own sums."""
    from nanovllm.kernels.zeroed_workspace import PendingSums
    from nanovllm.layers.linear import RowParallelLinear
    from nanovllm.quantization import weight_only
    from nanovllm.checkpoints.quantized_checkpoint import write_awq_checkpoint
    from nanovllm.checkpoints.random_checkpoint import write_tiny_model
    source = write_tiny_model(str(tmp_path / "source"), seed=21, hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    path = write_awq_checkpoint(source, str(tmp_path / "awq"), group_size=128)
    prompts = mixed_prompts(500, lengths=(7, 30, 1), seed=5)
    # the batch shrinks to one row, which takes the GEMV on Hopper too (two rows and more go to its GEMM)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 10, 4)]
    pending = []
    gemv = weight_only.int4_gemv
    monkeypatch.setattr(weight_only, "int4_gemv",
                        lambda *a, **kw: (out := gemv(*a, **kw), pending.append(isinstance(out, PendingSums)))[0])
    left, _ = generate_and_free(path, prompts, params, device="cuda", dtype="bfloat16", enforce_eager=True)
    assert any(pending)
    pending.clear()
    in_graphs, _ = generate_and_free(path, prompts, params, device="cuda", dtype="bfloat16")
    assert any(pending) and in_graphs == left
    pending.clear()
    monkeypatch.setattr(RowParallelLinear, "feed_residual_norm", lambda self: None)
    finished, _ = generate_and_free(path, prompts, params, device="cuda", dtype="bfloat16", enforce_eager=True)
    assert not any(pending) and finished == left
