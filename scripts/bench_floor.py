"""The memory-bandwidth floor of bench.py's workload for a model shape: the fewest bytes decode must
read (every cached token's K/V at every decode step, plus the weights once per step), over the
bandwidth a GPU copies at.

    python scripts/bench_floor.py configs/qwen3-0.6b.json [--kv-bytes 2] [--bandwidth 3.0e12]

Weights: every parameter once per step, except an untied input embedding (only the rows of the
step's tokens are read). Assumes all 256 requests decode side by side (the pool holds them), so
there are max(output length) decode steps; prefill is not counted.
"""
import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nanovllm.utils.bench_workload import bench_requests


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per stored K/V element (1 for fp8)")
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s the GPU copies")
    args = parser.parse_args()
    with open(args.config) as f:
        raw = json.load(f)
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    weight_bytes = 0
    for name, p in model.named_parameters(remove_duplicate=True):
        if "embed_tokens" in name and not config.tie_word_embeddings:
            continue
        if ".experts." in name:         # a MoE layer reads only the experts its tokens pick
            continue
        weight_bytes += p.numel() * 2
    experts = getattr(config, "num_experts", 0)
    if experts:                         # at large batch every expert is picked: count them all
        expert_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n)
        weight_bytes += expert_bytes
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * args.kv_bytes
    requests = bench_requests()
    prompt_lens, output_lens = [len(prompt) for prompt, _ in requests], [n for _, n in requests]
    steps = max(output_lens)
    token_reads = sum(sum(p + t for t in range(1, o + 1)) for p, o in zip(prompt_lens, output_lens))
    kv_bytes = token_reads * kv_per_token
    total = kv_bytes + weight_bytes * steps
    seconds = total / args.bandwidth
    tokens = sum(output_lens)
    print(f"{args.config}: K/V {kv_per_token:,.0f} B/token x {token_reads / 1e6:.1f} M reads = {kv_bytes / 1e12:.2f} TB; "
          f"weights {weight_bytes / 1e9:.2f} GB x {steps} steps = {weight_bytes * steps / 1e12:.2f} TB; "
          f"floor {seconds:.2f} s = {tokens / seconds:,.0f} tok/s ({tokens} tokens at {args.bandwidth / 1e12:.1f} TB/s)")


if __name__ == "__main__":
    main()
