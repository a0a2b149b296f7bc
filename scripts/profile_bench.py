"""Where bench.py's time goes: GPU-busy time of prefill and decode steps over the whole workload
and the time the GPU sat idle waiting for the host, then a kernel breakdown of a window of decode steps (torch profiler).
With --decode-batch B: only the breakdown, of decode steps at batch B (rank 0's GPU under tensor parallelism),
beside each step's wall time; what the kernels leave of it is the device waiting (host, other ranks).

    PYTHONPATH=. python scripts/profile_bench.py --config configs/qwen3-0.6b.json
    PYTHONPATH=. python scripts/profile_bench.py --config configs/qwen3-8b.json --decode-batch 1 --tensor-parallel-size 2
"""
import argparse
import time
from collections import defaultdict

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.bench_workload import bench_requests
from nanovllm.checkpoints.random_checkpoint import cached_shape

KERNEL_GROUPS = [("attention", ("_decode_kernel", "_prefill_kernel", "flash", "attention",
                                 "fmha", "cutlass::fmha")),
                 ("communication", ("nccl", "one_shot", "all_reduce", "allgather", "symm")),
                 ("fused MoE", ("_grouped_gemm_kernel",)), ("rms norm", ("_rms_norm",)), ("q/k norm, rotary, KV store", ("_rotary",)),
                 ("silu*mul", ("_silu_and_mul",)), ("activation quant", ("_quantize_kernel",)), ("GEMM", ("gemm", "cutlass", "sm90", "nvjet", "cublas")),
                 ("sampler", ("_chunk_summary", "_pick_token", "softmax", "argmax", "gather"))]


def group_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k.lower() in name for k in keys)), "other")


def warmed_bench_engine(config: str, kv_cache_dtype: str, num_seqs: int,
                        quantization: str | None = None, **engine_args) -> tuple[LLM, list, list]:
    """An engine over random weights of a shape, after one warm-up request, and bench.py's requests."""
    llm = LLM(cached_shape(config), load_format="dummy", kv_cache_dtype=kv_cache_dtype, quantization=quantization,
              **engine_args)
    requests = bench_requests(num_seqs)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens) for _, max_tokens in requests]
    llm.generate(["warm-up"], SamplingParams(), use_tqdm=False)
    return llm, [prompt for prompt, _ in requests], params


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default=None, choices=["fp8", "awq", "gptq"], help="as bench.py's")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--decode-batch", type=int, default=0, help="profile decode steps at this batch only")
    args = parser.parse_args()
    llm, prompts, params = warmed_bench_engine(args.config, args.kv_cache_dtype, args.num_seqs, args.quantization,
                                               tensor_parallel_size=args.tensor_parallel_size,
                                               pipeline_parallel_size=args.pipeline_parallel_size)
    if args.decode_batch:
        profile_decode_batch(llm, args.decode_batch, args.profile_steps)
        llm.shutdown()
        return

    # Events around every launched step, on one clock: a step's GPU time runs from when the device
    # reaches it (its start, or the previous step's end if later) to its end; a start after the
    # previous end is time the device sat idle waiting for the host.
    runner = llm.engine.core.executor
    original_launch, original_execute = runner.launch, runner.driver.execute
    marks, started = [], {}

    def timed_execute(inputs, **kwargs):    # the step's inputs are built on the host before this
        started["event"] = torch.cuda.Event(enable_timing=True)
        started["event"].record()
        return original_execute(inputs, **kwargs)

    def timed_launch(batch, **kwargs):
        context = sum(seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens))
        step = original_launch(batch, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        marks.append(("prefill" if batch.is_prefill else "decode", len(batch.seqs), context, started["event"], end))
        return step

    runner.launch, runner.driver.execute = timed_launch, timed_execute
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    runner.launch, runner.driver.execute = original_launch, original_execute
    tokens = sum(len(o["token_ids"]) for o in outputs)
    print(f"workload: {tokens} output tokens in {wall:.2f} s = {tokens / wall:,.0f} tok/s")
    totals, counts, previous_end = defaultdict(float), defaultdict(int), 0.0
    hf = llm.config.hf_config
    kv_itemsize = 1 if args.kv_cache_dtype == "fp8" else 2
    kv_bytes_per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * kv_itemsize
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.driver.model.parameters())
    buckets = [(128, 256), (64, 127), (16, 63), (1, 15)]
    idles = []                              # (ms, step index, kind, batch)
    for index, (kind, num_seqs, context, start, end) in enumerate(marks):
        start_ms, end_ms = origin.elapsed_time(start), origin.elapsed_time(end)
        busy = (end_ms - max(start_ms, previous_end)) / 1e3
        idle_ms = max(0.0, start_ms - previous_end)
        totals[kind + " idle"] += idle_ms / 1e3
        idles.append((idle_ms, index, kind, num_seqs))
        totals[kind + " busy"] += busy
        counts[kind] += 1
        previous_end = end_ms
        if kind == "decode":   # by batch size: GPU time against the bytes a step must read
            bucket = next(b for b in buckets if b[0] <= num_seqs <= b[1])
            counts[bucket] += 1
            totals[bucket] += busy
            totals[bucket, "bytes"] += weight_bytes + context * kv_bytes_per_token
    for kind in ("prefill", "decode"):
        print(f"{kind:8s}: {counts[kind]:5d} steps, GPU busy {totals[kind + ' busy']:6.2f} s, "
              f"GPU idle before them (waiting for the host) {totals[kind + ' idle']:5.2f} s")
    idles.sort(reverse=True)
    print("longest waits for the host: " + ", ".join(f"{ms:.2f} ms before step {i} ({kind}, {n} seqs)"
                                                     for ms, i, kind, n in idles[:8]))
    print(f"waits over 0.2 ms: {sum(ms > 0.2 for ms, *_ in idles)} steps, {sum(ms for ms, *_ in idles if ms > 0.2):.1f} ms; "
          f"shorter: {sum(ms for ms, *_ in idles if ms <= 0.2):.1f} ms")
    for low, high in buckets:
        seconds, nbytes = totals[low, high], totals[(low, high), "bytes"]
        print(f"  decode at batch {low:3d}-{high:3d}: {counts[low, high]:4d} steps, GPU busy {seconds:5.2f} s, "
              f"{nbytes / 1e12:5.2f} TB of weights + KV = {nbytes / max(seconds, 1e-9) / 1e12:4.2f} TB/s "
              f"(at 3.0 TB/s: {nbytes / 3e12:5.2f} s)")

    # kernel breakdowns from a fresh run: its first prefill steps, then decode steps in the middle
    for prompt, p in zip(prompts, params):
        llm.engine.add_request(prompt, p)
    kernel_breakdown(llm, "prefill", 3)
    for _ in range(300):
        llm.engine.step()
    kernel_breakdown(llm, "decode", args.profile_steps, table=True)
    while not llm.engine.is_finished():
        llm.engine.step()


def profile_decode_batch(llm, batch: int, steps: int) -> None:
    """Decode steps of `batch` sequences of 128-token prompts, after they are all prefilled."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 40)
    for i in range(batch):
        llm.engine.add_request([(31 * i + j) % 10000 for j in range(128)], params)
    for _ in range(20):
        llm.engine.step()
    kernel_breakdown(llm, f"decode at batch {batch}", steps, table=True)
    while not llm.engine.is_finished():
        llm.engine.step()


def kernel_breakdown(llm, label: str, steps: int, table: bool = False) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    groups = defaultdict(float)
    for e in events:
        groups[group_of(e.key)] += e.self_device_time_total
    print(f"\n{label} window: {steps} steps, GPU kernel time {total / 1e3:.1f} ms ({total / 1e3 / steps:.2f} ms/step); "
          f"wall {wall_ms:.2f} ms/step under the profiler, {wall_ms - total / 1e3 / steps:.2f} ms of it no kernel ran")
    for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:10s} {us / 1e3:8.2f} ms  {100 * us / total:5.1f}%")
    if table:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))

if __name__ == "__main__":
    main()
