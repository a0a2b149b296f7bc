"""Does another cuBLAS path run the decode GEMMs faster than torch's default? torch can route a
bf16 product through cuBLAS (`cublasGemmEx`) or cuBLASLt, which pick kernels by their own
heuristics; and a residual added by the GEMM itself (addmm, beta = 1) costs what over a plain one?
Qwen3-0.6B projections and its LM head, each GEMM over SETS weight sets in one CUDA graph (weights
not in L2), us per call, outputs compared with the default path.

    PYTHONPATH=. python scripts/blas_library_check.py
"""
import torch
import torch.nn.functional as F

from scripts.graph_timing import graph_of, replay_ms

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
ROWS = (16, 64, 128, 256)
SETS = 16


def variants(x: torch.Tensor, residual: torch.Tensor, weights: list[torch.Tensor]) -> dict:
    """name -> (BLAS library, reductions in bf16 allowed, the calls of one graph)"""
    linear = lambda: [F.linear(x, w) for w in weights]
    return {"cublas": ("cublas", True, linear),
            "cublaslt": ("cublaslt", True, linear),
            "cublas, fp32 split-K sums": ("cublas", False, linear),
            "cublaslt, fp32 split-K sums": ("cublaslt", False, linear),
            "cublas, + residual (addmm)": ("cublas", True, lambda: [torch.addmm(residual, x, w.t()) for w in weights])}


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    default_library = torch.backends.cuda.preferred_blas_library()
    default_reduction = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    names = list(variants(None, None, []))
    print("| GEMM (N, K) | M | " + " | ".join(names) + " | max abs difference against cublas |")
    print("| --- | --- | " + " | ".join("---" for _ in names) + " | --- |")
    totals = {m: [0.0] * len(names) for m in ROWS}
    for gemm, (n, k) in SHAPES.items():
        sets = 2 if gemm == "lm_head" else SETS
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(sets)]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
            times, outs = [], []
            for library, reduced, calls in variants(x, residual, weights).values():
                torch.backends.cuda.preferred_blas_library(library)
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
                graph, out = graph_of(calls)
                times.append(replay_ms(graph) * 1e3 / sets)
                outs.append(out[0].float())
                del graph
            torch.backends.cuda.preferred_blas_library(default_library)
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = default_reduction
            diff = max(float((o - outs[0]).abs().max()) for o in outs)
            if gemm != "lm_head":
                totals[m] = [t + u for t, u in zip(totals[m], times)]
            print(f"| {gemm} ({n}, {k}) | {m} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {diff:.2g} |",
                  flush=True)
        del weights
    print("\n| M | a layer's four GEMMs: " + " | ".join(names) + " |\n| --- | " + " | ".join("---" for _ in names) + " |")
    for m, sums in totals.items():
        print(f"| {m} | " + " | ".join(f"{t:.1f}" for t in sums) + " |")


if __name__ == "__main__":
    main()
