"""Offline throughput in the shape of nano-vllm's benchmark.

256 requests, prompt and output lengths each uniform in [100, 1024] (random.seed(0)), random token
ids below 10000, temperature 0.6, ignore_eos, max_model_len 4096; one warm-up request, then
throughput = output tokens / wall time.

    python bench.py --model ~/huggingface/Qwen3-0.6B
    python bench.py --config configs/qwen3-0.6b.json     # random weights of that shape, drawn on the device

--structured-json runs the workload twice on one engine: unconstrained, then with every request
under one JSON schema (BENCH_SCHEMA: records that never complete within the output lengths, so every
token is sampled under a mask), and prints both throughputs and the host time spent filling masks
(and advancing the grammars' matchers by the sampled tokens).
With --config the tokenizer is one of text pieces (random_checkpoint.write_text_piece_tokenizer),
of the config's vocabulary size, so that JSON can be written and masks cost what a real one's would.
"""
import argparse
import json
import time

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.checkpoints.bench_workload import add_model_arguments, bench_requests, model_engine_args
from nanovllm.checkpoints.random_checkpoint import cached_shape

# an array of small typed records, at least 400 of them: longer than any output here
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 400, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "name": {"type": "string", "maxLength": 8},
                       "kind": {"enum": ["alpha", "beta", "gamma"]},
                       "ok": {"type": "boolean"},
                       "score": {"type": "number"}},
        "required": ["id", "name", "kind", "ok"]}}},
    "required": ["records"],
}


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
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--disable-custom-all-reduce", action="store_true", help="tensor-parallel sums by NCCL only")
    parser.add_argument("--enable-prefix-caching", type=int, default=1, help="1 or 0")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default=None, choices=["fp8", "awq", "gptq"],
                        help="fp8: quantize the 16-bit weights while loading (per-channel float8); awq, gptq: "
                             "with --config, random weights stored 4-bit as those checkpoints are (group 128)")
    parser.add_argument("--kv-offload-gib", type=float, default=0.0, help="the prefix cache's host tier")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--structured-json", action="store_true",
                        help="also run every request under a JSON schema, and compare")
    args = parser.parse_args()

    engine_args = model_engine_args(args)
    if args.structured_json and args.config:     # a vocabulary in which JSON can be written
        engine_args["model"] = cached_shape(args.config, text_pieces=True)
    if args.disable_custom_all_reduce:
        engine_args["disable_custom_all_reduce"] = True
    llm = LLM(**engine_args, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size, enforce_eager=args.enforce_eager,
              enable_prefix_caching=bool(args.enable_prefix_caching), kv_cache_dtype=args.kv_cache_dtype,
              kv_offload_gib=args.kv_offload_gib, quantization=args.quantization,
              speculative_config=args.speculative_config)

    requests = bench_requests(args.num_seqs, (args.min_input_len, args.max_input_len),
                              (args.min_output_len, args.max_output_len))
    prompts = [prompt for prompt, _ in requests]
    sampling_params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
                       for _, max_tokens in requests]

    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    throughput = run(llm, prompts, sampling_params)
    if args.structured_json:
        structured = StructuredOutputsParams(json=BENCH_SCHEMA, disable_any_whitespace=True)
        llm.generate(["Benchmark: "], SamplingParams(structured_outputs=structured), use_tqdm=False)  # compiles
        for sp in sampling_params:
            sp.structured_outputs = structured
        before = llm.stats()
        constrained = run(llm, prompts, sampling_params, "JSON schema: ")
        after = llm.stats()
        seconds, accept_seconds, steps, rows = (after[key] - before[key] for key in (
            "structured_output_mask_seconds", "structured_output_accept_seconds", "structured_output_mask_steps",
            "structured_output_masked_rows"))
        print(f"JSON schema / unconstrained: {constrained / throughput:.1%}; host mask filling: {seconds:.2f}s, "
              f"{1e3 * seconds / max(steps, 1):.2f} ms per step over {steps} steps, "
              f"{1e6 * seconds / max(rows, 1):.1f} us per row, {rows} rows masked; matchers accepting the "
              f"sampled tokens: {1e3 * accept_seconds / max(steps, 1):.2f} ms per step")


def run(llm: LLM, prompts, sampling_params, label: str = "") -> float:
    """Generate the workload; print and return its throughput (output tokens per second)."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = sum(len(o["token_ids"]) for o in outputs)
    assert total == sum(sp.max_tokens for sp in sampling_params)
    print(f"{label}Total: {total}tok, Time: {elapsed:.2f}s, Throughput: {total / elapsed:.2f}tok/s")
    return total / elapsed


if __name__ == "__main__":
    main()
