"""Where the host spends bench.py's steps: for every engine step the time in scheduling, launching
(building the inputs, queueing the kernels) and collecting the step before (waiting for it, then
updating the sequences), and the garbage collections that ran inside it. Prints the slowest
steps and the totals; with --sync-debug, torch also warns at every operation that waits for the
device.

    PYTHONPATH=. python scripts/host_step_timing.py [--config configs/qwen3-0.6b.json] [--sync-debug]
"""
import argparse
import gc
import time

import torch

from scripts.profile_bench import warmed_bench_engine


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--sync-debug", action="store_true")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the run")
    parser.add_argument("--num-seqs", type=int, default=256)
    args = parser.parse_args()
    engine, prompts, params = warmed_bench_engine(args.config, args.kv_cache_dtype, args.num_seqs)
    steps, current = [], {}

    def timed(owner, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - start
        setattr(owner, name, wrapper)

    for owner, name in ((engine.scheduler, "schedule"), (engine.model_runner, "launch"), (engine, "_collect"),
                        (engine.model_runner, "_wait_for_device")):
        timed(owner, name)
    gc_start = {}

    def on_gc(phase, info):
        if phase == "start":
            gc_start["t"] = time.perf_counter()
        else:
            current.setdefault("gc", []).append((info["generation"], time.perf_counter() - gc_start["t"]))
    gc.callbacks.append(on_gc)
    original_step = engine._step

    def step():
        current.clear()
        start = time.perf_counter()
        out = original_step()
        steps.append(dict(current, total=time.perf_counter() - start))
        return out
    engine._step = step
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    if args.sync_debug:
        torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0

    tokens = sum(len(o["token_ids"]) for o in outputs)
    print(f"{tokens} tokens in {wall:.2f} s = {tokens / wall:,.0f} tok/s; {len(steps)} steps; "
          f"host outside steps {wall - sum(s['total'] for s in steps):.3f} s")
    phases = ("schedule", "launch", "_collect", "_wait_for_device")
    for phase in phases:
        print(f"  {phase}: {sum(s.get(phase, 0.0) for s in steps):.3f} s")
    collections = [c for s in steps for c in s.get("gc", [])]
    for generation in (0, 1, 2):
        times = [t for g, t in collections if g == generation]
        if times:
            print(f"  gc generation {generation}: {len(times)} collections, {sum(times) * 1e3:.1f} ms, "
                  f"longest {max(times) * 1e3:.2f} ms")
    print("steps with the most host time outside waiting for the device (ms):")
    busy = sorted(range(len(steps)), key=lambda i: steps[i]["total"] - steps[i].get("_wait_for_device", 0.0))
    for i in reversed(busy[-10:]):
        s = steps[i]
        print(f"  step {i}: total {s['total'] * 1e3:.2f}, " + ", ".join(f"{p} {s.get(p, 0.0) * 1e3:.2f}" for p in phases)
              + (f", gc {[(g, round(t * 1e3, 2)) for g, t in s['gc']]}" if "gc" in s else ""))


if __name__ == "__main__":
    main()
