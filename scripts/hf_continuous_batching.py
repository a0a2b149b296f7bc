"""Hugging Face transformers' own continuous batching on bench.py's workload, for a side-by-side
ratio: same requests, per-request max_new_tokens, EOS off, temperature 0.6.

    PYTHONPATH=. python scripts/hf_continuous_batching.py --config configs/qwen3-0.6b.json
    PYTHONPATH=. python scripts/hf_continuous_batching.py --cuda-graphs --max-requests-per-batch 256   # tuned

transformers' defaults (no CUDA graphs, its own batch limit) are far slower than the tuned
configuration; docs/benchmarks.md compares against the tuned one.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from nanovllm.checkpoints.bench_workload import bench_requests
from nanovllm.checkpoints.random_checkpoint import cached_random_checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=300, help="seconds; report partial results after")
    parser.add_argument("--attn", default="paged|sdpa")
    parser.add_argument("--cuda-graphs", action="store_true", help="ContinuousBatchingConfig(use_cuda_graph=True)")
    parser.add_argument("--max-requests-per-batch", type=int, help="ContinuousBatchingConfig's limit")
    args = parser.parse_args()
    prompts, max_tokens = map(list, zip(*bench_requests(args.num_seqs)))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = cached_random_checkpoint(args.config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=args.attn).to(device)
    gen_config = GenerationConfig(do_sample=True, temperature=0.6, max_new_tokens=max(max_tokens), eos_token_id=-1)
    config_args = dict(auto_switch_to_flash=False)
    if args.cuda_graphs:
        config_args["use_cuda_graph"] = True
    if args.max_requests_per_batch:
        config_args["max_requests_per_batch"] = args.max_requests_per_batch
    kwargs = {}
    try:
        from transformers.generation import ContinuousBatchingConfig
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**config_args)
    except (ImportError, TypeError):
        if len(config_args) > 1:
            raise SystemExit("--cuda-graphs and --max-requests-per-batch need transformers' ContinuousBatchingConfig")
    manager = model.init_continuous_batching(generation_config=gen_config, **kwargs)
    manager.start()
    try:
        warm = manager.add_request([1, 2, 3], max_new_tokens=8, eos_token_id=-1)
        while manager.get_result(warm, timeout=60) is None:
            pass
        start = time.perf_counter()
        for prompt, n in zip(prompts, max_tokens):
            manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
        done, tokens = 0, 0
        while done < len(prompts) and time.perf_counter() - start < args.timeout:
            result = manager.get_result(timeout=1)
            if result is not None:
                done += 1
                tokens += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)   # with requests left, transformers logs an error here
    note = "" if done == len(prompts) else f" (stopped after {args.timeout:.0f} s: partial)"
    tuning = "".join(f", {k}={v}" for k, v in config_args.items())
    print(f"transformers {args.attn}{tuning}: {done}/{len(prompts)} requests, {tokens} tokens in {elapsed:.2f} s = "
          f"{tokens / elapsed:,.0f} tok/s{note}")


if __name__ == "__main__":
    main()
