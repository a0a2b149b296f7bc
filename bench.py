"""Offline throughput in the shape of nano-vllm's benchmark.

256 requests, prompt and output lengths each uniform in [100, 1024] (random.seed(0)), random token
ids below 10000, temperature 0.6, ignore_eos, max_model_len 4096; one warm-up request, then
throughput = output tokens / wall time.

    python bench.py --model ~/huggingface/Qwen3-0.6B
    python bench.py --config configs/qwen3-0.6b.json     # random weights of that shape, drawn on the device
"""
import argparse
import time

from nanovllm import LLM, SamplingParams
from nanovllm.utils.bench_workload import add_model_arguments, bench_requests, model_engine_args


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-input-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--min-output-len", type=int, default=100)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--enable-prefix-caching", type=int, default=1, help="1 or 0")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default=None, choices=["fp8", "awq", "gptq"],
                        help="fp8: quantize the 16-bit weights while loading (per-channel float8); awq, gptq: "
                             "with --config, random weights stored 4-bit as those checkpoints are (group 128)")
    parser.add_argument("--kv-offload-gib", type=float, default=0.0, help="the prefix cache's host tier")
    args = parser.parse_args()

    llm = LLM(**model_engine_args(args), max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
              enable_prefix_caching=bool(args.enable_prefix_caching), kv_cache_dtype=args.kv_cache_dtype,
              kv_offload_gib=args.kv_offload_gib, quantization=args.quantization)

    requests = bench_requests(args.num_seqs, (args.min_input_len, args.max_input_len),
                              (args.min_output_len, args.max_output_len))
    prompts = [prompt for prompt, _ in requests]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
                       for _, max_tokens in requests]

    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = sum(len(o["token_ids"]) for o in outputs)
    assert total == sum(sp.max_tokens for sp in sampling_params)
    print(f"Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")


if __name__ == "__main__":
    main()
