"""Latency at fixed batch sizes, against the memory-bandwidth floor of a decode step.

For each batch size: a warm-up run, then one timed run of that many prompts of --input-len random
token ids, each generating exactly --output-len tokens (EOS ignored, greedy). TTFT and TPOT are
each request's own, as the engine reports them in its output's metrics (time to the first token
from the request's arrival; time per token after the first), as mean, p50 and p99 over the batch;
tok/s is the batch's output tokens over the timed run's wall time. All figures come from that one
run, so none is a difference of two runs that load can turn negative. Every run uses prompts of
its own, so no run hits the prefix cache.

The floor is the time a decode step must take to read what it reads, at --bandwidth-tbps: the
model's weights as the device holds them (the bytes of every parameter and buffer of the loaded
model, so a quantized format counts as stored; without the input embedding unless it is tied to
the LM head, since a step reads only its tokens' rows, and without the rotary table), plus the
K/V of every cached token of the batch, at the mean context of the decode steps. Of a mixture of
experts it counts the experts a batch is expected to reach (see decode_weight_bytes). The share of
the floor is the floor over the mean TPOT.

    python bench_latency.py --config configs/qwen3-8b.json
    python bench_latency.py --model ~/huggingface/Qwen3-0.6B --batch-sizes 1,4 --kv-cache-dtype fp8

Prints one line per batch size, then one JSON line with every figure.
"""
import argparse
import json
import random
import time

import numpy as np
import torch
from torch import nn

from nanovllm import LLM, SamplingParams
from nanovllm.layers.moe import SparseMoeBlock
from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.checkpoints.bench_workload import add_model_arguments, model_engine_args


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 4, 16, 64], help="comma-separated")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=512, help="tokens generated per request (>= 2)")
    parser.add_argument("--bandwidth-tbps", type=float, default=3.0, help="device read bandwidth of the floor, TB/s")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--disable-custom-all-reduce", action="store_true", help="tensor-parallel sums by NCCL only")
    parser.add_argument("--max-model-len", type=int, help="default: input len + output len")
    parser.add_argument("--quantization", help="passed to LLM when given")
    parser.add_argument("--speculative-config", type=json.loads, help="JSON object, passed to LLM when given")
    args = parser.parse_args(argv)
    if args.input_len < 1:
        parser.error(f"--input-len must be >= 1, got {args.input_len}")
    if args.output_len < 2:
        parser.error(f"--output-len must be >= 2 (TPOT needs a token after the first), got {args.output_len}")
    if args.bandwidth_tbps <= 0:
        parser.error(f"--bandwidth-tbps must be > 0, got {args.bandwidth_tbps}")
    return args


def engine_args(args: argparse.Namespace) -> dict:
    """LLM's arguments; the optional ones only when given, so the script runs on engines that do not
    know them."""
    kwargs = dict(model_engine_args(args), kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
                  max_model_len=args.max_model_len or args.input_len + args.output_len)
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1:
        kwargs.update(tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size)
    if args.disable_custom_all_reduce:
        kwargs["disable_custom_all_reduce"] = True
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.speculative_config is not None:
        kwargs["speculative_config"] = args.speculative_config
    return kwargs


def decode_weight_bytes(model: nn.Module, batch_size: int | None = None) -> int:
    """Bytes of the weights a decode step of batch_size tokens reads, as held on the device: every
    parameter and buffer, once each, except an untied input embedding and the rotary table (a step
    reads their rows for its tokens and positions only). A mixture of experts' stacked experts count
    by the share of them the batch is expected to reach when each token picks k of E uniformly,
    1 - (1 - k / E) ** batch_size (all of them when batch_size is None)."""
    skipped = {id(t) for m in model.modules() if isinstance(m, RotaryEmbedding) for t in m.buffers()}
    embedding = model.get_submodule("model.embed_tokens").weight
    if not getattr(model, "tie_word_embeddings", False):
        skipped.add(id(embedding))
    share = {}
    for m in model.modules():
        if isinstance(m, SparseMoeBlock) and batch_size is not None:
            reached = 1 - (1 - m.top_k / m.experts.num_experts) ** batch_size
            share.update({id(p): reached for p in m.experts.parameters()})
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skipped}
    return round(sum(t.numel() * t.element_size() * share.get(key, 1.0) for key, t in tensors.items()))


def random_prompts(rng: random.Random, count: int, length: int, vocab_size: int) -> list[list[int]]:
    top = min(10000, vocab_size) - 1
    return [[rng.randint(0, top) for _ in range(length)] for _ in range(count)]


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[dict], float]:
    """The outputs of one generate call and its wall time in seconds."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if any(len(o["token_ids"]) != max_tokens for o in outputs):
        raise RuntimeError(f"a request stopped before its {max_tokens} tokens")
    return outputs, elapsed


def spread_ms(seconds: list[float]) -> tuple[float, float, float]:
    """Mean, p50 and p99 (linear interpolation between the nearest ranks), in ms."""
    p50, p99 = np.percentile(seconds, [50, 99])
    return float(np.mean(seconds)) * 1e3, float(p50) * 1e3, float(p99) * 1e3


def measure(llm: LLM, args: argparse.Namespace, model: nn.Module, kv_bytes_per_token: int) -> list[dict]:
    rng = random.Random(0)
    vocab_size = llm.config.model_config.vocab_size
    bandwidth = args.bandwidth_tbps * 1e12
    mean_context = args.input_len + args.output_len / 2    # decode steps see input len + 1 .. + output len - 1
    results = []
    for batch in args.batch_sizes:
        timed_generate(llm, random_prompts(rng, batch, args.input_len, vocab_size), 2)   # warm-up at this batch
        outputs, wall = timed_generate(llm, random_prompts(rng, batch, args.input_len, vocab_size), args.output_len)
        ttft_ms, ttft_p50_ms, ttft_p99_ms = spread_ms([o["metrics"]["time_to_first_token"] for o in outputs])
        tpot_ms, tpot_p50_ms, tpot_p99_ms = spread_ms([o["metrics"]["time_per_output_token"] for o in outputs])
        step_bytes = decode_weight_bytes(model, batch) + batch * mean_context * kv_bytes_per_token
        floor_ms = step_bytes / bandwidth * 1e3
        results.append(dict(batch_size=batch, ttft_ms=ttft_ms, ttft_p50_ms=ttft_p50_ms, ttft_p99_ms=ttft_p99_ms,
                            tpot_ms=tpot_ms, tpot_p50_ms=tpot_p50_ms, tpot_p99_ms=tpot_p99_ms,
                            tok_per_s=batch * args.output_len / wall, wall_ms=wall * 1e3, floor_ms=floor_ms,
                            step_bytes=step_bytes, pct_of_floor=100 * floor_ms / tpot_ms))
    return results


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    llm = LLM(**engine_args(args))
    try:
        runner = llm.engine.core.executor.driver     # rank 0's worker: its model and KV cache
        weight_bytes = decode_weight_bytes(runner.model)
        kv_bytes_per_token = runner.kv_cache.block_bytes // runner.kv_cache.block_size
        results = measure(llm, args, runner.model, kv_bytes_per_token)
    finally:
        llm.shutdown()
    for r in results:
        print(f"batch {r['batch_size']:>3}: TTFT {r['ttft_ms']:9.2f} ms, TPOT {r['tpot_ms']:7.3f} ms, "
              f"{r['tok_per_s']:10,.0f} tok/s, floor {r['floor_ms']:7.3f} ms ({r['step_bytes'] / 1e9:.3f} GB per step "
              f"at {args.bandwidth_tbps} TB/s), {r['pct_of_floor']:5.1f}% of floor")
    report = dict(model=args.model or args.config, device=torch.cuda.get_device_name() if torch.cuda.is_available()
                  else "cpu", input_len=args.input_len, output_len=args.output_len,
                  kv_cache_dtype=args.kv_cache_dtype, bandwidth_tbps=args.bandwidth_tbps,
                  weight_bytes=weight_bytes, kv_bytes_per_token=kv_bytes_per_token, results=results)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
