"""Per-op GPU times of a decode step on the Qwen3-0.6B shape (bf16), against each op's memory floor:
the four GEMMs of a layer through cuBLAS (F.linear) and through a plain Triton tile kernel, the
sampler, and q/k norm + rotary as one fused kernel against three.

    PYTHONPATH=. python scripts/decode_op_timing.py

do_bench times each call from the host, so for kernels of a few microseconds the launch overhead
is part of every number: compare the columns with each other, and take in-graph kernel times from
scripts/profile_bench.py.
"""
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from nanovllm.kernels.rms_norm import rms_norm
from nanovllm.kernels.rotary_embedding import apply_rotary
from nanovllm.kernels.sampling import gumbel_argmax

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936
GEMMS = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
         "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
COPY_BW = 3.0e12   # bytes/s a device-to-device copy reaches on the H100 here


def us(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


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


def tile_linear(x, w, block_m, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _tile_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, w, y, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def main():
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for name, (n, k) in GEMMS.items()}
    print("GEMMs of one layer, us (floor = weight bytes / 3.0 TB/s)")
    print("  M | " + " | ".join(f"{name} cuBLAS / best Triton (config)" for name in GEMMS) + " | layer cuBLAS / best")
    for m in (16, 64, 200):
        row, total_cublas, total_best = [], 0.0, 0.0
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], dtype=torch.bfloat16, device="cuda")
            t_cublas = us(lambda: F.linear(x, w))
            best = (float("inf"), None)
            block_ms = sorted({max(16, min(triton.next_power_of_2(m), 64)), max(16, min(triton.next_power_of_2(m), 128))})
            for bm, bn, bk, warps, stages in itertools.product(block_ms, (32, 64, 128), (128,), (4,), (3, 5)):
                try:
                    y = tile_linear(x, w, bm, bn, bk, warps, stages)
                    err = ((y.float() - F.linear(x, w).float()).norm() / F.linear(x, w).float().norm()).item()
                    assert err < 1e-2, err
                    t = us(lambda: tile_linear(x, w, bm, bn, bk, warps, stages))
                except Exception as e:
                    print(f"    {name} {bm}x{bn}x{bk} s{stages}: {type(e).__name__} {e}"[:200])
                    continue
                best = min(best, (t, (bm, bn, bk, stages)))
            floor = w.numel() * 2 / COPY_BW * 1e6
            row.append(f"{t_cublas:5.1f} / {best[0]:5.1f} {best[1]} (floor {floor:4.1f})")
            total_cublas += t_cublas
            total_best += min(t_cublas, best[0])
        print(f"{m:3d} | " + " | ".join(row) + f" | {total_cublas:5.1f} / {total_best:5.1f}")

    print("\nsampler (Gumbel-max, temperature 0.6) over the vocabulary, us")
    for rows in (1, 64, 200, 256):
        logits = torch.randn(rows, VOCAB, dtype=torch.bfloat16, device="cuda")
        temps = torch.full((rows,), 0.6, device="cuda")
        seeds = torch.randint(0, 2**62, (rows,), device="cuda")
        t = us(lambda: gumbel_argmax(logits, temps, seeds))
        print(f"rows {rows:3d}: {t:6.1f} us (floor {logits.numel() * 2 / COPY_BW * 1e6:5.1f})")

    print("\nq/k RMSNorm + rotary, us: fused kernel vs two norms then rotary")
    cache = torch.randn(40960, HEAD_DIM, device="cuda")
    qw, kw = torch.randn(HEAD_DIM, dtype=torch.bfloat16, device="cuda"), torch.randn(HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    for tokens in (1, 64, 200, 256):
        qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        q, k, _ = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        pos = torch.randint(0, 40960, (tokens,), device="cuda")
        fused = us(lambda: apply_rotary(pos, q, k, cache, (qw, kw), 1e-6))
        three = us(lambda: apply_rotary(pos, rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), cache))
        print(f"tokens {tokens:3d}: fused {fused:5.1f}  three kernels {three:5.1f}")


if __name__ == "__main__":
    main()
