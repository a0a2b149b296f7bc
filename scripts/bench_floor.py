"""The floor of bench.py's workload for a model shape: the fewest bytes decode must read (every
cached token's K/V at every decode step, plus the weights once per step) over the bandwidth a GPU
copies at, then that plus the prefill's GEMM FLOPs at the GPU's dense peak (which matters from the
8B shape up, where prefill is a sixth of the run).

    python scripts/bench_floor.py configs/qwen3-0.6b.json [--kv-bytes 1] [--bandwidth 3.0e12] [--peak-tflops 989]
    python scripts/bench_floor.py configs/qwen3-30b-a3b-fp8.json --kv-bytes 1 --linear-bytes 1 --peak-tflops 1979

Weights: every parameter once per step, except an untied input embedding (only the rows of the
step's tokens are read). Assumes all 256 requests decode side by side (the pool holds them), so
there are max(output length) decode steps. Prefill FLOPs: 2 per weight a prompt token goes through
(not the embedding or the LM head, which runs for the last token only; a MoE token goes through its
top-k experts), attention's own FLOPs left out (under 2% here).
"""
import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nanovllm.checkpoints.bench_workload import bench_requests


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="config.json of a model shape (see configs/)")
    parser.add_argument("--kv-bytes", type=float, default=2.0, help="bytes per stored K/V element (1 for fp8)")
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s the GPU copies")
    parser.add_argument("--linear-bytes", type=float, default=2.0,
                        help="bytes per weight of the projections and experts (1 for FP8, about 0.53 for 4 bits)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense 16-bit TFLOP/s (H100 SXM: 989)")
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
        weight_bytes += p.numel() * (args.linear_bytes if name.endswith("_proj.weight") else 2)
    experts = getattr(config, "num_experts", 0)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if experts:                         # at large batch every expert is picked: count them all
        weight_bytes += expert_params * args.linear_bytes
    # weights a prompt token goes through in prefill
    token_params = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False)
                       if "embed_tokens" not in n and "lm_head" not in n and ".experts." not in n)
    if experts:
        token_params += expert_params * config.num_experts_per_tok / experts
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
    prefill_flops = 2 * token_params * sum(prompt_lens)
    prefill_seconds = prefill_flops / (args.peak_tflops * 1e12)
    print(f"{args.config}: K/V {kv_per_token:,.0f} B/token x {token_reads / 1e6:.1f} M reads = {kv_bytes / 1e12:.2f} TB; "
          f"weights {weight_bytes / 1e9:.2f} GB x {steps} steps = {weight_bytes * steps / 1e12:.2f} TB; "
          f"floor {seconds:.2f} s = {tokens / seconds:,.0f} tok/s ({tokens} tokens at {args.bandwidth / 1e12:.1f} TB/s)")
    print(f"{args.config}: prefill {prefill_flops / 1e15:.2f} PFLOP = {prefill_seconds:.2f} s at {args.peak_tflops:.0f} "
          f"TFLOP/s; floor with prefill {seconds + prefill_seconds:.2f} s = {tokens / (seconds + prefill_seconds):,.0f} tok/s")


if __name__ == "__main__":
    main()
