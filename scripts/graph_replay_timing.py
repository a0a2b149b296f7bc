"""Host time of the first and the second replay of each decode CUDA graph of a fresh engine. A
graph's first launch also uploads it to the device, and the host waits for that; the engine does
it at start-up since this script found it (run it in an older checkout to see the difference).

    PYTHONPATH=. python scripts/graph_replay_timing.py [--config configs/qwen3-0.6b.json]
"""
import argparse
import time

import torch

from nanovllm import LLM
from nanovllm.utils.random_checkpoint import cached_shape


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/qwen3-0.6b.json")
    args = parser.parse_args()
    llm = LLM(cached_shape(args.config), load_format="dummy")
    graphs = llm.model_runner.graphs.graphs
    print("batch size | first replay (ms) | second replay (ms), host time of the launch call")
    firsts, seconds = [], []
    for size, graph in sorted(graphs.items()):
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            times.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
        firsts.append(times[0])
        seconds.append(times[1])
        print(f"{size:>10} | {times[0]:17.3f} | {times[1]:.3f}")
    print(f"all {len(graphs)} graphs: first replays {sum(firsts):.1f} ms, second replays {sum(seconds):.1f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()
