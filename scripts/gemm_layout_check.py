"""Do the decode GEMMs run faster with the weight stored transposed? cuBLAS picks its kernel by
shape and layout: `F.linear(x, W)` with W [N, K] is a "TN" product, `x @ Wt` with Wt [K, N]
contiguous an "NN" one. Qwen3-0.6B and Qwen3-8B projections, bf16, each GEMM over 16 weight sets
in one CUDA graph (weights not in L2), us per call; outputs compared.

    PYTHONPATH=. python scripts/gemm_layout_check.py [--prefill]

--prefill times prefill-sized products (M = 4096 and 16384) instead.
"""
import sys

import torch
import torch.nn.functional as F

from scripts.graph_timing import graph_of, replay_ms

SHAPES = {"0.6B qkv": (4096, 1024), "0.6B o": (1024, 2048), "0.6B gate_up": (6144, 1024), "0.6B down": (1024, 3072),
          "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288)}
ROWS = (16, 64, 128, 200, 256)
SETS = 16


def main() -> None:
    global ROWS
    if "--prefill" in sys.argv:
        ROWS = (4096, 16384)
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| GEMM (N, K) | M | W [N, K]: F.linear | Wt [K, N]: x @ Wt | max abs difference |")
    print("| --- | --- | --- | --- | --- |")
    totals = {m: [0.0, 0.0] for m in ROWS}
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(SETS)]
        transposed = [w.t().contiguous() for w in weights]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            graph_a, out_a = graph_of(lambda: [F.linear(x, w) for w in weights])
            graph_b, out_b = graph_of(lambda: [x @ wt for wt in transposed])
            graph_a.replay()
            graph_b.replay()
            torch.cuda.synchronize()
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out_a, out_b))
            t_a, t_b = replay_ms(graph_a) * 1e3 / SETS, replay_ms(graph_b) * 1e3 / SETS
            if name.startswith("0.6B"):
                totals[m][0] += t_a
                totals[m][1] += t_b
            print(f"| {name} ({n}, {k}) | {m} | {t_a:.1f} | {t_b:.1f} | {diff:.2g} |", flush=True)
            del graph_a, graph_b
        del weights, transposed
    print("\n| M | 0.6B layer's four GEMMs, W [N, K] | Wt [K, N] |\n| --- | --- | --- |")
    for m, (a, b) in totals.items():
        print(f"| {m} | {a:.1f} | {b:.1f} |")


if __name__ == "__main__":
    main()
