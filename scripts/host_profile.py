"""Python's profiler over bench.py's timed run: which host functions the engine's steps spend their
time in (the device work they wait for shows under `_wait_for_device`).

    PYTHONPATH=. python scripts/host_profile.py [--config configs/qwen3-0.6b.json] [--sort tottime]
"""
import argparse
import cProfile
import pstats
import time

from scripts.profile_bench import warmed_bench_engine


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--sort", default="cumulative", choices=["cumulative", "tottime"])
    parser.add_argument("--lines", type=int, default=45)
    args = parser.parse_args()
    llm, prompts, params = warmed_bench_engine(args.config, args.kv_cache_dtype, args.num_seqs)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    wall = time.perf_counter() - start
    tokens = sum(len(o["token_ids"]) for o in outputs)
    print(f"{tokens} tokens in {wall:.2f} s under the profiler")
    pstats.Stats(profiler).sort_stats(args.sort).print_stats(args.lines)


if __name__ == "__main__":
    main()
