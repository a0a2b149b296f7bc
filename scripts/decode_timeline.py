"""Where a decode step's time goes between and inside its kernels: the engine's decode graph
replayed under the torch profiler at several batch sizes, contexts uniform in [100, 2048] as in
bench.py. For each kernel group: launches and time per step; then the gaps, the time between one
kernel's end and the next one's start inside the step (negative where PDL lets them overlap),
summed by the group of the kernel that follows the gap.

    PYTHONPATH=. python scripts/decode_timeline.py [--config configs/qwen3-0.6b.json] [--kv-cache-dtype fp8]
"""
import argparse
from collections import defaultdict

import numpy as np
import torch

from nanovllm import LLM
from nanovllm.layers.sampler import SamplingTensors
from nanovllm.worker.step_inputs import StepInputs, padded_block_tables
from nanovllm.utils.random_checkpoint import cached_random_checkpoint
from scripts.profile_bench import group_of

STEPS = 10


def decode_inputs(contexts: np.ndarray, block_size: int, vocab: int) -> StepInputs:
    """One decode token per sequence, each sequence in its own blocks."""
    blocks = -(-contexts // block_size)
    first = np.concatenate(([0], np.cumsum(blocks)[:-1]))
    tables = padded_block_tables([list(range(start, start + n)) for start, n in zip(first, blocks)])
    last = contexts - 1
    slots = tables[np.arange(len(contexts)), last // block_size] * block_size + last % block_size
    cu = np.arange(len(contexts) + 1)
    return StepInputs(False, np.random.randint(0, vocab, len(contexts)), last, slots, contexts, cu, tables, cu[1:] - 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = parser.parse_args()
    llm = LLM(cached_random_checkpoint(args.config), kv_cache_dtype=args.kv_cache_dtype)
    runner, config = llm.model_runner, llm.config
    rng = np.random.default_rng(0)
    used = 256 * -(-2048 // config.kvcache_block_size)
    cache = runner.kv_cache.tensor[:, :, :used]            # never time on zeros
    if cache.element_size() == 1:
        cache.view(torch.uint8).random_(0, 120)            # finite float8 values
    else:
        cache.normal_()
    for batch in (16, 64, 128, 256):
        contexts = rng.integers(100, 2049, batch)
        inputs = decode_inputs(contexts, config.kvcache_block_size, config.hf_config.vocab_size)
        sampling = SamplingTensors(torch.full((batch,), 0.6, device="cuda"),
                                   torch.randint(0, 2**62, (batch,), device="cuda"))
        step = lambda: runner.sampler(runner.execute(inputs), sampling)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS):
            step()
        end.record()
        torch.cuda.synchronize()
        wall_ms = start.elapsed_time(end) / STEPS
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                step()
                torch.cuda.synchronize()     # steps apart, so that a gap never spans two steps
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, launches, gaps, gap_counts = defaultdict(float), defaultdict(int), defaultdict(float), defaultdict(int)
        kernels = [(begin, finish, group_of(name)) for begin, finish, name in kernels]
        for (_, previous_finish, _), (begin, _, group) in zip(kernels, kernels[1:]):
            if begin - previous_finish < 50:  # inside a step; longer is the host between steps
                gaps[group] += begin - previous_finish
                gap_counts[group] += 1
        for begin, finish, group in kernels:
            busy[group] += finish - begin
            launches[group] += 1
        kernel_us = sum(busy.values()) / STEPS
        gap_us = sum(gaps.values()) / STEPS
        print(f"\nbatch {batch} ({args.kv_cache_dtype} cache), mean context {contexts.mean():.0f}: step {wall_ms * 1e3:.0f} us "
              f"(events, no profiler); kernels {kernel_us:.0f} us + gaps {gap_us:.0f} us per step (profiled)")
        print("| group | launches | kernel us | us per launch | gap before it, us per step | per launch |")
        print("| --- | --- | --- | --- | --- | --- |")
        for group in sorted(busy, key=lambda g: -busy[g]):
            n = launches[group] / STEPS
            print(f"| {group} | {n:.0f} | {busy[group] / STEPS:.1f} | {busy[group] / STEPS / n:.2f} "
                  f"| {gaps[group] / STEPS:.1f} | {gaps[group] / max(gap_counts[group], 1):.2f} |")


if __name__ == "__main__":
    main()
