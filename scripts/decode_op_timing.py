"""In-graph GPU times of a decode step's small ops on the Qwen3-0.6B shape (bf16), against each op's
memory floor: the four GEMMs of a layer through cuBLAS (F.linear) and through a plain Triton tile
kernel at several tile shapes, the sampler, and q/k norm + rotary + KV store.

Each op runs over LAYERS distinct weight sets inside one CUDA graph (as the decode graph runs it:
no launch gaps from the host, weights not in L2); a graph replay's time / LAYERS is the op's time.

    PYTHONPATH=. python scripts/decode_op_timing.py
"""
import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.rotary_embedding import KVStore, apply_rotary
from nanovllm.kernels.sampling import gumbel_argmax

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936
GEMMS = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
         "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
LAYERS = 16
COPY_BW = 3.0e12   # bytes/s a device-to-device copy reaches on the H100 here
TILES = {64: [(64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 5)],
         200: [(256, 64, 64, 8, 3), (256, 64, 64, 8, 4), (256, 128, 64, 8, 3), (256, 32, 128, 4, 3),
               (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 128, 4, 4), (64, 32, 128, 4, 5)]}


def graph_us(fn, reps: int = 20) -> float:
    """fn(i) runs the op on weight set i; median replay time / LAYERS, in microseconds."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(LAYERS):   # compile and warm up outside the capture
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times)) * 1e3 / LAYERS


@triton.jit
def _tile_linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * K + (k + rk)[None, :], mask=(rm < M)[:, None], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + (k + rk)[None, :], mask=(rn < N)[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


def tile_linear(x, w, y, block_m, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    _tile_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, w, y, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def main():
    torch.manual_seed(0)
    weights = {name: [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
               for name, (n, k) in GEMMS.items()}
    print(f"GEMMs in a CUDA graph, us per call (floor = weight bytes / {COPY_BW / 1e12:.1f} TB/s)")
    for m in TILES:
        total_cublas, total_best = 0.0, 0.0
        for name, ws in weights.items():
            x = torch.randn(m, ws[0].shape[1], dtype=torch.bfloat16, device="cuda")
            y = torch.empty(m, ws[0].shape[0], dtype=torch.bfloat16, device="cuda")
            t_cublas = graph_us(lambda i: torch.matmul(x, ws[i].t(), out=y))
            row = []
            best = t_cublas
            for tile in TILES[m]:
                try:
                    expected = F.linear(x, ws[0]).float()
                    err = (tile_linear(x, ws[0], y, *tile).float() - expected).norm() / expected.norm()
                    assert err < 1e-2, f"error {err:.3g}"
                    t = graph_us(lambda i: tile_linear(x, ws[i], y, *tile))
                except Exception as e:
                    row.append(f"{tile}: {type(e).__name__}")
                    continue
                best = min(best, t)
                row.append(f"{tile}: {t:.1f}")
            total_cublas += t_cublas
            total_best += best
            floor = ws[0].numel() * 2 / COPY_BW * 1e6
            print(f"M={m:3d} {name:7s} floor {floor:4.1f} | cuBLAS {t_cublas:5.1f} | Triton (bm, bn, bk, warps, stages): "
                  + ", ".join(row))
        print(f"M={m:3d} layer: cuBLAS {total_cublas:5.1f} us, best of cuBLAS and Triton per GEMM {total_best:5.1f} us")

    print("\nsampler (Gumbel-max, temperature 0.6), in a graph, us")
    for rows in (64, 200):
        logits = [torch.randn(rows, VOCAB, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        temps = torch.full((rows,), 0.6, device="cuda")
        seeds = torch.randint(0, 2**62, (rows,), device="cuda")
        t = graph_us(lambda i: gumbel_argmax(logits[i], temps, seeds))
        print(f"rows {rows:3d}: {t:6.1f} us (floor {logits[0].numel() * 2 / COPY_BW * 1e6:5.1f})")

    print("\nq/k norm + rotary + KV store, in a graph, us")
    cache = torch.randn(40960, HEAD_DIM, device="cuda")
    qw = torch.randn(HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    kw = torch.randn(HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.zeros(64, 256, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    for tokens in (64, 200):
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        pos = torch.randint(0, 40960, (tokens,), device="cuda")
        slots = torch.randperm(64 * 256, device="cuda")[:tokens]
        t = graph_us(lambda i: apply_rotary(pos, q, k, cache, (qw, kw), 1e-6, KVStore(v, k_cache, v_cache, slots)))
        print(f"tokens {tokens:3d}: {t:5.1f} us")


if __name__ == "__main__":
    main()
