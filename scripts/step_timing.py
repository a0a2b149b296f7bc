"""Decode step time at batch 1, 64 and 256 with 1K-token contexts, the decode attention kernel's
bandwidth, and prefill tokens/s (nothing cached; and one sequence continuing a cached prefix, as
the later chunks of a long prompt do), for a Qwen3 shape with random weights (default: 0.6B, bf16).

    PYTHONPATH=. python scripts/step_timing.py --config configs/qwen3-0.6b.json
"""
import argparse

import numpy as np
import torch

from nanovllm import LLM
from nanovllm.worker.step_inputs import StepInputs
from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode_attention
from nanovllm.layers.sampler import SamplingTensors
from nanovllm.utils.random_checkpoint import cached_random_checkpoint


def median_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def step_inputs(num_seqs: int, context: int, block_size: int, is_prefill: bool, vocab: int,
                cached: int = 0) -> StepInputs:
    """num_seqs sequences of `context` tokens in distinct blocks: prefill computes all of them
    (the first sequence all but its `cached` first ones, as a later chunk of a long prompt does),
    decode only the last."""
    blocks = -(-context // block_size)
    tables = np.arange(num_seqs * blocks).reshape(num_seqs, blocks)
    q_lens = np.full(num_seqs, context if is_prefill else 1)
    q_lens[0] -= cached
    positions = np.concatenate([np.arange(context - n, context) for n in q_lens])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    cu = np.concatenate(([0], np.cumsum(q_lens)))
    return StepInputs(is_prefill, np.random.randint(0, vocab, len(positions)), positions, slots,
                      np.full(num_seqs, context), cu, tables, cu[1:] - 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    llm = LLM(cached_random_checkpoint(args.config))
    runner, config = llm.model_runner, llm.config
    hf = config.hf_config
    block_size, vocab = config.kvcache_block_size, hf.vocab_size
    used_blocks = 256 * -(-args.context // block_size)
    runner.kv_cache.tensor[:, :, :used_blocks].normal_()      # never time on zeros
    kv_bytes_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * 2
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    print(f"weights {weight_bytes / 1e9:.2f} GB, KV {kv_bytes_per_token} bytes/token, SMs {runner.backend.num_sms}")

    print("\nbatch | decode step ms (model+LM head+sampling) | GB/s of weights+KV | attention kernel ms (one layer) | its GB/s")
    for batch in (1, 64, 256):
        inputs = step_inputs(batch, args.context, block_size, False, vocab)
        sampling = SamplingTensors(torch.full((batch,), 0.6, device="cuda"),
                                   torch.randint(0, 2**62, (batch,), device="cuda"))
        step_ms = median_ms(lambda: runner.sampler(runner.execute(inputs), sampling))
        step_bytes = weight_bytes + batch * args.context * kv_bytes_per_token
        layer = runner.attention_layers[0]
        q = torch.randn(batch, layer.num_heads, layer.head_dim, device="cuda", dtype=config.torch_dtype)
        lens = torch.full((batch,), args.context, device="cuda")
        tables = torch.from_numpy(inputs.block_tables).cuda()
        splits = decode_num_splits(batch, layer.num_kv_heads, runner.backend.num_sms)
        attn_ms = median_ms(lambda: paged_decode_attention(q, layer.k_cache, layer.v_cache, lens, tables,
                                                           layer.scale, splits), reps=100)
        attn_bytes = batch * args.context * kv_bytes_per_token / hf.num_hidden_layers
        print(f"{batch:5d} | {step_ms:8.3f} | {step_bytes / step_ms / 1e6:7.0f} | {attn_ms:.4f} (splits {splits}) "
              f"| {attn_bytes / attn_ms / 1e6:7.0f}")

    for seqs, context, cached in ((16, 1024, 0), (4, 4096, 0), (17, 1024, 1024 - 16)):
        inputs = step_inputs(seqs, context, block_size, True, vocab, cached)
        tokens = len(inputs.input_ids)
        ms = median_ms(lambda: runner.execute(inputs), reps=10, warmup=2)
        what = f", the first {cached} of one cached" if cached else ""
        print(f"prefill {seqs} x {context} tokens{what}: {ms:.2f} ms = {tokens / ms * 1e3:,.0f} tokens/s")


if __name__ == "__main__":
    main()
