"""In-graph GPU times of a decode step's small ops on the Qwen3-0.6B shape (bf16), against each op's
memory floor: the four GEMMs of a layer through cuBLAS (F.linear) and through a split-K Triton
kernel over a sweep of tiles and split counts (split 1 is a plain tile kernel), also at Qwen3-8B
shapes; then the sampler, and q/k norm + rotary + KV store.

Each op runs over LAYERS distinct weight sets inside one CUDA graph (as the decode graph runs it:
no launch gaps from the host, weights not in L2); a graph replay's time / LAYERS is the op's time.

    PYTHONPATH=. python scripts/decode_op_timing.py
"""
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.rotary_embedding import KVStore, apply_rotary
from nanovllm.kernels.sampling import gumbel_argmax
from scripts.graph_timing import graph_of, replay_ms

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 1024, 16, 8, 128, 3072, 151936
GEMMS = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
         "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
         "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (24576, 4096), "8B down": (4096, 12288)}
LAYERS = 16
COPY_BW = 3.0e12   # bytes/s a device-to-device copy reaches on the H100 here
ROWS = (16, 64, 128, 200, 256)      # decode batch sizes
SPLITS = (1, 2, 4, 8)


def graph_us(fn) -> float:
    """fn(i) runs the op on weight set i; median replay time / LAYERS, in microseconds."""
    graph, _ = graph_of(lambda: [fn(i) for i in range(LAYERS)])
    return replay_ms(graph) * 1e3 / LAYERS


@triton.jit
def _split_k_linear_kernel(x_ptr, w_ptr, y_ptr, partial_ptr, arrivals_ptr, M, N, K, stride_x, k_per_split,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m, split, splits = tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * k_per_split + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols[:, None] * K + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):     # the host keeps k_per_split a multiple of BLOCK_K
        x = tl.load(x_ptrs, mask=(rows < M)[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=(cols < N)[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    y_offs = rows[:, None] * N + cols[None, :]
    if splits == 1:
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + split * M * N + y_offs, acc, mask=mask)
        tl.debug_barrier()                       # every thread's partial is written before we signal
        tile = pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(arrivals_ptr + tile, 1) == splits - 1:    # acq_rel: the others' partials are visible
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(splits):
                total += tl.load(partial_ptr + s * M * N + y_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(arrivals_ptr + tile, 0)


_arrivals: dict[torch.device, torch.Tensor] = {}   # one zeroed counter per tile, kept zero between calls
MAX_TILES = 4096


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int, block_k: int,
                   splits: int, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x @ weight.T with each output tile's K range split over `splits` programs: each writes a
    float32 partial, and the last to finish (an atomic counter per tile tells which) sums them in
    split order, writes the tile and zeroes the counter. K must be a multiple of splits * block_k."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] == k and k % (splits * block_k) == 0
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    assert grid[0] * grid[1] <= MAX_TILES
    if x.device not in _arrivals:
        _arrivals[x.device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=x.device)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = torch.empty(splits if splits > 1 else 0, m, n, dtype=torch.float32, device=x.device)
    _split_k_linear_kernel[grid](x, weight, y, partial, _arrivals[x.device], m, n, k, x.stride(0), k // splits,
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                 num_warps=num_warps, num_stages=num_stages)
    return y


def tiles_for(m: int) -> list[tuple[int, int, int, int, int]]:
    """(block_m, block_n, block_k, warps, stages) worth trying at m rows."""
    block_ms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, m) and bm * 4 >= m]
    return [(bm, bn, bk, 8 if bm * bn >= 128 * 128 else 4, stages)
            for bm, bn, bk, stages in itertools.product(block_ms, (32, 64, 128), (64, 128), (3, 4))
            if (bm + bn) * bk * 2 * stages <= 200_000]    # shared memory


def main():
    torch.manual_seed(0)
    print(f"GEMMs in a CUDA graph, us per call (floor = weight bytes / {COPY_BW / 1e12:.1f} TB/s)")
    for name, (n, k) in GEMMS.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
        floor = n * k * 2 / COPY_BW * 1e6
        for m in ROWS if not name.startswith("8B") else (64, 256):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            expected = F.linear(x, ws[0]).float()
            t_cublas = graph_us(lambda i: F.linear(x, ws[i]))
            results = []
            for tile, splits in itertools.product(tiles_for(m), SPLITS):
                bm, bn, bk, warps, stages = tile
                if k % (splits * bk):
                    continue
                run = lambda i: split_k_linear(x, ws[i], bm, bn, bk, splits, warps, stages)
                try:
                    y = run(0)
                    err = ((y.float() - expected).norm() / expected.norm()).item()
                    assert err < 1e-2, f"error {err:.3g}"
                    assert torch.equal(y, run(0)), "not deterministic"
                    results.append((graph_us(run), tile, splits))
                except Exception as e:
                    print(f"  {name} M={m} {tile} splits {splits}: {type(e).__name__}: {str(e)[:120]}")
            results.sort()
            top = ", ".join(f"{t:.1f} {tile} s{sp}" for t, tile, sp in results[:3])
            print(f"{name:10s} M={m:3d} floor {floor:5.1f} | cuBLAS {t_cublas:6.1f} | "
                  f"best (bm, bn, bk, warps, stages): {top}", flush=True)

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
