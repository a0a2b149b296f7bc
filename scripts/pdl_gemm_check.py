"""Does a Triton GEMM that reads its weights into L2 before waiting for the previous kernel beat
cuBLAS on the decode GEMMs of Qwen3-0.6B (bf16, H100)?

A decode step runs RMSNorm (Triton, programmatic dependent launch) -> GEMM for every projection.
The GEMMs there are bound by per-kernel latency, not bandwidth. With programmatic dependent launch
(PDL) a kernel may be scheduled while the one before it drains; one that waits
(griddepcontrol.wait) only before it touches the previous kernel's output can fetch its weights
meanwhile. Measured here, each as a pair "RMSNorm -> GEMM" over LAYERS distinct weight sets inside
one CUDA graph (weights not in L2, no host gaps), graph replay time / LAYERS:

    (a) RMSNorm -> F.linear (cuBLAS)
    (b) RMSNorm -> Triton GEMM that waits first
    (c) RMSNorm -> Triton GEMM that prefetches its weight slab into L2, then waits
    (d) as (c), and the RMSNorm lets its dependents launch right after its own wait (early trigger)

plus each GEMM and the RMSNorm alone. The Triton GEMM's tile is swept per shape at a few batch
sizes (M); the other M try the best tiles of the nearest swept M. Every output is checked against
F.linear, eagerly and after a graph replay whose norm outputs were zeroed first (a missing wait
would read zeros).

    PYTHONPATH=. python scripts/pdl_gemm_check.py [--quick]

--quick sweeps only M in (64, 200) with fewer tiles (a first run).
"""
import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from scripts.graph_timing import graph_of, replay_ms

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
GEMMS = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM),
         "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}     # (N, K)
ROWS = (1, 16, 64, 128, 200, 256)
SWEPT_ROWS = (64, 200)
TOP_TILES = 3          # best tiles of the nearest swept M tried at the other M
LAYERS = 16
EPS = 1e-6
REL_TOL = 2e-2
LINE_BYTES = 128
DEVICE = "cuda"


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, eps, K, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     EARLY_TRIGGER: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            # the GEMM may be scheduled now; its own wait still covers everything this kernel writes
            tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / K + eps)
    w = tl.load(weight_ptr + cols, mask=mask)
    out = w.to(tl.float32) * h.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * K + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, early_trigger: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """One row per program; launched with PDL on a GPU (the interpreter knows no griddepcontrol)."""
    m, k = x.shape
    assert x.is_contiguous()
    out = torch.empty_like(x) if out is None else out
    block = triton.next_power_of_2(k)
    pdl = x.is_cuda
    _rms_norm_kernel[(m,)](x, weight, out, EPS, k, BLOCK=block, PDL=pdl, EARLY_TRIGGER=early_trigger and pdl,
                           num_warps=4 if block <= 2048 else 8, **({"launch_pdl": True} if pdl else {}))
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


@triton.jit(do_not_specialize=["M"])     # one compile serves every batch size
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                   ELEMS_PER_LINE: tl.constexpr, PDL: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    if PREFETCH:
        # the weights are not written by the previous kernel, so they may be read before the wait;
        # the programs of one N tile (one per M tile) share its slab's lines between them
        slab = w_ptr + pid_n * BLOCK_N * K                 # rows pid_n * BLOCK_N.. are contiguous
        slab_lines = tl.cdiv(tl.minimum(BLOCK_N, N - pid_n * BLOCK_N) * K, ELEMS_PER_LINE)
        for first in range(pid_m * PREFETCH_LINES, slab_lines, tl.num_programs(1) * PREFETCH_LINES):
            lines = tl.minimum(first + tl.arange(0, PREFETCH_LINES), slab_lines - 1)   # repeats are harmless
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [slab + lines * ELEMS_PER_LINE], dtype=tl.int32,
                                      is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * K + ks[None, :]
    w_ptrs = w_ptr + cols[:, None] * K + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K, BLOCK_K):                         # the host keeps K a multiple of BLOCK_K
        x = tl.load(x_ptrs, mask=(rows < M)[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=(cols < N)[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int, int, int, int],
                  prefetch: bool) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T; tile = (block_m, block_n, block_k, warps, stages). Launched with
    PDL on a GPU; the prefetch (inline PTX) and the waits are left out under the interpreter."""
    block_m, block_n, block_k, warps, stages = tile
    m, k = x.shape
    n = weight.shape[0]
    if not (x.is_contiguous() and weight.is_contiguous() and weight.shape[1] == k):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be contiguous [M, K] and [N, K]")
    if k % block_k:
        raise ValueError(f"K={k} is not a multiple of block_k={block_k}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = x.is_cuda
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _linear_kernel[grid](x, weight, y, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         PREFETCH=prefetch and pdl, PREFETCH_LINES=32 * warps,
                         ELEMS_PER_LINE=LINE_BYTES // weight.element_size(), PDL=pdl,
                         num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return y


def tiles_for(m: int, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(block_m, block_n, block_k, warps, stages) swept at m rows."""
    block_ms = [bm for bm in (16, 64, 128) if bm <= max(16, triton.next_power_of_2(m))]
    if quick:
        return list(itertools.product(block_ms, (64, 128), (128,), (4,), (3, 4)))
    # 8 warps only on tiles big enough to give each warp its own 64 x 64 share or more (fewer compiles)
    return [(bm, bn, bk, warps, stages)
            for bm, bn, bk, warps, stages in itertools.product(block_ms, (32, 64, 128), (64, 128), (4, 8), (3, 4))
            if warps == 4 or bm * bn >= 64 * 64]


def capture(fn):
    """A CUDA graph of fn(i) for every weight set i, and the outputs it writes on replay."""
    return graph_of(lambda: [fn(i) for i in range(LAYERS)])


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    """Median replay time / LAYERS, in microseconds."""
    return replay_ms(graph) * 1e3 / LAYERS


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


class Bench:
    """Inputs of one (shape, M): LAYERS weight sets, the norm's input, and the norm outputs the graphs
    write (one per layer, so zeroing them before a replay shows whether each GEMM waited)."""

    def __init__(self, n: int, k: int, m: int, weights: list[torch.Tensor]):
        self.weights = weights
        self.x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
        self.norm_weight = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(torch.bfloat16)
        self.normed = [torch.empty(m, k, dtype=torch.bfloat16, device=DEVICE) for _ in range(LAYERS)]
        h = rms_norm_ref(self.x, self.norm_weight)
        self.ref_alone = [F.linear(self.x, w).float() for w in weights]
        self.ref_pair = [F.linear(h, w).float() for w in weights]

    def pair(self, gemm, early_trigger: bool = False):
        def fn(i):
            return gemm(rms_norm(self.x, self.norm_weight, early_trigger, out=self.normed[i]), self.weights[i])
        return fn

    def alone(self, gemm):
        return lambda i: gemm(self.x, self.weights[i])

    def time(self, fn, paired: bool) -> float:
        """In-graph us per call; raises if an output is off, eagerly or after a replay."""
        refs = self.ref_pair if paired else self.ref_alone
        err = rel_err(fn(0), refs[0])
        if err > REL_TOL:
            raise ValueError(f"eager error {err:.3g}")
        graph, outputs = capture(fn)
        for h in self.normed:
            h.zero_()
        graph.replay()
        torch.cuda.synchronize()
        err = max(rel_err(y, ref) for y, ref in zip(outputs, refs))
        if err > REL_TOL:
            raise ValueError(f"in-graph error {err:.3g}")
        return replay_us(graph)


def time_tiles(bench: Bench, tiles, variants: dict, failures: list, label: str) -> dict:
    """Per variant name: {tile: us} over the tiles that compiled and passed."""
    times = {name: {} for name in variants}
    for tile in tiles:
        for name, (make_fn, paired) in variants.items():
            try:
                times[name][tile] = bench.time(make_fn(tile), paired)
            except Exception as e:     # out of shared memory, or a wrong result
                failures.append(f"{label} {name} {tile}: {type(e).__name__}: {str(e).strip()[:100]}")
    return times


def fastest(tile_times: dict) -> tuple[float, tuple | None]:
    return min(((t, tile) for tile, t in tile_times.items()), default=(float("inf"), None))


def nearest_swept_tiles(m: int, swept_times: dict[int, dict]) -> list:
    """The TOP_TILES best tiles of every variant at the nearest swept M, block_m clamped to what m
    needs, without repeats."""
    times = swept_times[min(swept_times, key=lambda s: abs(s - m))]
    cap = max(16, triton.next_power_of_2(m))
    tiles = []
    for tile_times in times.values():
        for tile in sorted(tile_times, key=tile_times.get)[:TOP_TILES]:
            clamped = (min(tile[0], cap),) + tile[1:]
            if clamped not in tiles:
                tiles.append(clamped)
    return tiles


def fmt(result) -> str:
    t, tile = result
    return "FAIL" if tile is None else f"{t:6.1f} {tile}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only M in (64, 200), fewer tiles")
    args = parser.parse_args()
    rows = SWEPT_ROWS if args.quick else ROWS
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
          f"triton {triton.__version__}")
    print(f"RMSNorm -> GEMM pairs in a CUDA graph over {LAYERS} weight sets, us per pair; tile = "
          "(block_m, block_n, block_k, warps, stages)\n")
    table = {}       # (shape, M) -> row
    layer_cublas = {m: 0.0 for m in rows}
    layer_best_d = {m: 0.0 for m in rows}
    failures = []
    started = time.time()
    for name, (n, k) in GEMMS.items():
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=DEVICE) * 0.02 for _ in range(LAYERS)]
        swept_times = {}     # swept M -> per variant {tile: us}
        for m in sorted(rows, key=lambda m: m not in SWEPT_ROWS):    # swept M first: the others reuse them
            bench = Bench(n, k, m, weights)
            t_norm = replay_us(capture(lambda i: rms_norm(bench.x, bench.norm_weight, out=bench.normed[i]))[0])
            t_cublas = bench.time(bench.alone(F.linear), paired=False)
            t_cublas_pair = bench.time(bench.pair(F.linear), paired=True)
            variants = {
                "alone": (lambda tile: bench.alone(lambda x, w: triton_linear(x, w, tile, False)), False),
                "alone+prefetch": (lambda tile: bench.alone(lambda x, w: triton_linear(x, w, tile, True)), False),
                "b": (lambda tile: bench.pair(lambda x, w: triton_linear(x, w, tile, False)), True),
                "c": (lambda tile: bench.pair(lambda x, w: triton_linear(x, w, tile, True)), True),
                "d": (lambda tile: bench.pair(lambda x, w: triton_linear(x, w, tile, True), True), True),
            }
            tiles = tiles_for(m, args.quick) if m in SWEPT_ROWS else nearest_swept_tiles(m, swept_times)
            times = time_tiles(bench, tiles, variants, failures, f"{name} M={m}")
            if m in SWEPT_ROWS:
                swept_times[m] = times
            best = {variant: fastest(tile_times) for variant, tile_times in times.items()}
            table[name, m] = (f"| {name} ({n}, {k}) | {m} | {t_norm:5.1f} | {t_cublas:5.1f} | {fmt(best['alone'])} | "
                              f"{fmt(best['alone+prefetch'])} | {t_cublas_pair:5.1f} | {fmt(best['b'])} | "
                              f"{fmt(best['c'])} | {fmt(best['d'])} |")
            layer_cublas[m] += t_cublas_pair
            layer_best_d[m] += best["d"][0]
            print(f"{name} M={m}: cuBLAS pair {t_cublas_pair:.1f}, best (d) {fmt(best['d'])} "
                  f"[{time.time() - started:.0f} s]", flush=True)
    print("\n| shape (N, K) | M | norm alone | cuBLAS alone | Triton alone | Triton+prefetch alone | "
          "(a) norm->cuBLAS | (b) norm->Triton | (c) prefetch | (d) prefetch+early trigger |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in GEMMS:
        for m in rows:
            print(table[name, m])
    print("\n| M | layer's 4 pairs, cuBLAS (a) | layer's 4 pairs, best (d) | (d) - (a) |\n|---|---|---|---|")
    for m in rows:
        print(f"| {m} | {layer_cublas[m]:6.1f} | {layer_best_d[m]:6.1f} | {layer_best_d[m] - layer_cublas[m]:+6.1f} |")
    if failures:
        print(f"\n{len(failures)} FAIL rows (tile skipped):")
        print("\n".join(failures))


if __name__ == "__main__":
    main()
