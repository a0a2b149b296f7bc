"""Beam search and n > 1 sampling at bench.py's prompt shape, random weights of a model shape.

    python scripts/bench_parallel_sampling.py --config configs/qwen3-0.6b.json

1. Beam search: width 4 over 64 prompts (lengths uniform in [100, 1024]), ignore_eos, max_tokens
   tokens per beam. Throughput counts every token a live beam computed (prompts x width x steps);
   the host share is the time the engine spent recording candidates, choosing beams and forking
   them (LLMEngine._propose_beams) over the wall time.
2. n = 4 samples per prompt (one request, the prompt prefilled once, its blocks shared) against 4
   separate requests per prompt (the same seeds), the same 64 prompts, in the same engine; with
   the host time between scheduling calls summed by the kind of step scheduled.
"""
import argparse
import time

from nanovllm import LLM, BeamSearchParams, SamplingParams
from nanovllm.utils.bench_workload import bench_requests
from nanovllm.utils.random_checkpoint import cached_shape


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-tokens", type=int, default=256)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--sample-tokens", type=int, default=512)
    args = parser.parse_args()
    llm = LLM(cached_shape(args.config), load_format="dummy")
    prompts = [prompt for prompt, _ in bench_requests(args.num_prompts)]
    llm.generate(["warm-up"], SamplingParams(), use_tqdm=False)

    engine = type(llm)
    propose = engine._propose_beams
    host = {"seconds": 0.0, "calls": 0}

    def timed_propose(self, *a, **k):
        start = time.perf_counter()
        propose(self, *a, **k)
        host["seconds"] += time.perf_counter() - start
        host["calls"] += 1

    engine._propose_beams = timed_propose
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.beam_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.beam_search(prompts, params)
    wall = time.perf_counter() - start
    engine._propose_beams = propose
    assert all(len(o["sequences"]) == args.beam_width for o in outputs)
    tokens = args.num_prompts * args.beam_width * args.beam_tokens
    print(f"beam search: width {args.beam_width}, {args.num_prompts} prompts, {args.beam_tokens} tokens: "
          f"{wall:.2f} s, {tokens / wall:,.0f} beam tok/s; choosing beams on the host {host['seconds']:.2f} s "
          f"({100 * host['seconds'] / wall:.1f}%) in {host['calls']} steps")

    schedule = llm.scheduler.schedule
    steps = []

    def recorded_schedule():
        batch = schedule()
        steps.append((time.perf_counter(), batch.is_prefill, len(batch.seqs), len(batch.block_copies)))
        return batch

    def step_summary() -> str:
        kinds = {}
        for (t0, prefill, num_seqs, copies), (t1, *_) in zip(steps, steps[1:]):
            kind = "prefill" if prefill else "decode" if num_seqs else "empty"
            count, seconds, total_copies = kinds.get(kind, (0, 0.0, 0))
            kinds[kind] = (count + 1, seconds + t1 - t0, total_copies + copies)
        steps.clear()
        return "; ".join(f"{kind} {count} steps {seconds:.2f} s ({copies} block copies)"
                         for kind, (count, seconds, copies) in kinds.items())

    llm.scheduler.schedule = recorded_schedule
    for run in (1, 2):
        one = [SamplingParams(n=args.n, temperature=0.6, seed=i, ignore_eos=True, max_tokens=args.sample_tokens)
               for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = llm.generate(prompts, one, use_tqdm=False)
        wall_n = time.perf_counter() - start
        steps_n = step_summary()
        total = sum(len(c["token_ids"]) for o in outputs for c in o["outputs"])
        separate = [SamplingParams(temperature=0.6, seed=i * args.n + j, ignore_eos=True, max_tokens=args.sample_tokens)
                    for i in range(len(prompts)) for j in range(args.n)]
        start = time.perf_counter()
        outputs = llm.generate([p for p in prompts for _ in range(args.n)], separate, use_tqdm=False)
        wall_separate = time.perf_counter() - start
        steps_separate = step_summary()
        assert total == sum(len(o["token_ids"]) for o in outputs)
        print(f"run {run}: n={args.n} in one request: {wall_n:.2f} s = {total / wall_n:,.0f} tok/s; "
              f"{args.n} separate requests: {wall_separate:.2f} s = {total / wall_separate:,.0f} tok/s "
              f"({wall_separate / wall_n:.2f}x the time)\n  n={args.n}: {steps_n}\n  separate: {steps_separate}")


if __name__ == "__main__":
    main()
