"""The transposed float8 decode GEMM with TMA loads (host tensor descriptors) against fp8_matmul's
plain loads on decode_tile's tiles, Qwen3-8B projections at 64-256 tokens, per-channel scales; each
TMA tile at 3-6 stages. On CUDA only. Result in docs/benchmarks.md (tried and did not pay).

    PYTHONPATH=. python scripts/fp8_tma_check.py
"""
import argparse
import json
import math
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor
sys.path.insert(0, "scripts")
from int_gemm_bench import graph_time, projections, random_fp8_layer, L2_BYTES
from nanovllm.kernels.fp8_linear import GemmTile, decode_tile, fp8_matmul, fp8_matmul_ref, quantize_activation


@triton.jit
def swap_tma_kernel(a_desc, a_s_ptr, w_desc, w_s_ptr, out_ptr, M, N, K, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    n0, m0 = pid_n * BLOCK_N, pid_m * BLOCK_M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k])
        a = a_desc.load([m0, k])
        acc = tl.dot(w, a.T, acc)
    cols = n0 + tl.arange(0, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok, col_ok = rows < M, cols < N
    acc = acc * tl.load(w_s_ptr + cols, mask=col_ok, other=0.0)[:, None] * tl.load(a_s_ptr + rows, mask=row_ok, other=0.0)[None, :]
    tl.store(out_ptr + rows[None, :] * N + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])


def swap_tma(x_q, x_s, w_q, w_s, tile):
    bn, bm, bk, warps, stages = tile
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x_q.device)
    a_desc = TensorDescriptor.from_tensor(x_q, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w_q, [bn, bk])
    swap_tma_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](a_desc, x_s, w_desc, w_s, out, m, n, k, BLOCK_N=bn, BLOCK_M=bm,
                                                             BLOCK_K=bk, STAGES=stages, num_warps=warps)
    return out


argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
model = json.load(open("configs/qwen3-8b.json"))
shapes = projections(model)
for m in (7, 241):
    w, s = random_fp8_layer(1024, 768, None)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_activation(x, 1024)
    ref = fp8_matmul_ref(xq, xs, w, s, 1024, torch.float32)
    o = swap_tma(xq, xs, w, s, (64, 128, 128, 4, 4)).float()
    print("tma error", ((o - ref).abs().max() / ref.abs().max()).item())
totals = {}
for name, (k, n) in shapes.items():
    layers = [random_fp8_layer(k, n, None) for _ in range(max(2, min(32, math.ceil(4 * L2_BYTES / (n * k)))))]
    for m in (64, 128, 192, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_activation(x, k)
        tile = decode_tile(m, n, 132, False) or GemmTile(256, 64, 128, 8, 5, swapped=True)
        t_plain = graph_time([lambda l=l: fp8_matmul(xq, xs, l[0], l[1], k, torch.bfloat16, None, tile) for l in layers])
        res = []
        for bn, bm, warps in ((tile.block_n, tile.block_m, tile.num_warps), (64, 64, 4), (64, 128, 4), (128, 128, 8),
                              (64, 256, 8), (128, 64, 4)):
            for stages in (3, 4, 5, 6):
                t = (bn, bm, 128, warps, stages)
                try:
                    res.append((graph_time([lambda l=l: swap_tma(xq, xs, l[0], l[1], t) for l in layers]), t))
                except Exception as e:
                    pass
        res.sort()
        totals.setdefault(m, [0.0, 0.0])
        totals[m][0] += t_plain
        totals[m][1] += res[0][0]
        print(f"{name:12} M={m:3d} plain {tile} {t_plain*1e6:.1f} us; tma best " + "; ".join(f"{tt*1e6:.1f} {t}" for tt, t in res[:3]), flush=True)
    del layers
    torch.cuda.empty_cache()
for m, (a, b) in totals.items():
    print(f"M={m}: x36 plain {a*36e3:.2f} ms, tma (best per shape) {b*36e3:.2f} ms")
