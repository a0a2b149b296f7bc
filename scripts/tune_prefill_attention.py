"""Sweep the paged prefill kernel's tile (query rows, keys per step, warps, pipeline stages) on the
Qwen3-0.6B attention shape (16 query / 8 KV heads of 128, bf16, 256-token blocks), over two batches:
bench.py's prefill steps (prompts uniform in [100, 1024] packed to 16,384 tokens, the first one
continuing a 500-token cached prefix) and four 4,096-token prompts. Every tile's output is checked
against the torch twin before it is timed.

    PYTHONPATH=. python scripts/tune_prefill_attention.py [--base DIR]   # DIR: time that checkout's kernel too
"""
import importlib.util
import itertools
import random
import sys

import torch
from triton.testing import do_bench

from nanovllm.kernels.paged_attention import paged_attention_ref, paged_prefill_attention, prefill_tile

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256


def batch(chunks: list[tuple[int, int]]):
    """Arguments of the kernel for (cached tokens, new tokens) per sequence, and its causal FLOPs."""
    blocks = [-(-(cached + new) // BLOCK) for cached, new in chunks]
    tables = torch.zeros(len(chunks), max(blocks), dtype=torch.int64)
    perm, start = torch.randperm(sum(blocks)), 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    k_cache = torch.randn(sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    q_lens = torch.tensor([new for _, new in chunks])
    cu = torch.cat((torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0))).int().cuda()
    q = torch.randn(int(q_lens.sum()), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([cached + new for cached, new in chunks], device="cuda")
    visible = sum(new * cached + new * (new + 1) // 2 for cached, new in chunks)   # (query, key) pairs
    args = (q, k_cache, torch.randn_like(k_cache), cu, int(q_lens.max()), lens, tables.cuda(), HEAD_DIM ** -0.5)
    return args, 4 * HEAD_DIM * HEADS * visible


def bench_chunks(budget: int = 16384) -> list[tuple[int, int]]:
    rng = random.Random(0)
    chunks, total = [(500, 300)], 300
    while total < budget:
        new = min(rng.randint(100, 1024), budget - total)
        chunks.append((0, new))
        total += new
    return chunks


def main():
    base = None
    if "--base" in sys.argv:
        path = sys.argv[sys.argv.index("--base") + 1] + "/nanovllm/kernels/paged_attention.py"
        spec = importlib.util.spec_from_file_location("base_paged_attention", path)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    torch.manual_seed(0)
    cases = {"bench prefill step": batch(bench_chunks()), "4 x 4096": batch([(0, 4096)] * 4)}
    refs = {name: paged_attention_ref(*args[:4], *args[5:]) for name, (args, _) in cases.items()}

    def measure(fn, name):
        args, flops = cases[name]
        out = fn(*args)
        torch.testing.assert_close(out.float(), refs[name].float(), atol=5e-2, rtol=5e-2)
        ms = do_bench(lambda: fn(*args), warmup=10, rep=50, return_mode="median")
        return ms, flops / ms / 1e9

    default = prefill_tile(torch.bfloat16, HEAD_DIM)
    if base is not None:
        print("base kernel: " + "  ".join(f"{name} {ms:.3f} ms {tf:.0f} TFLOP/s"
                                         for name in cases for ms, tf in [measure(base.paged_prefill_attention, name)]))
    results = []
    for tile in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        try:
            row = [measure(lambda *a: paged_prefill_attention(*a, tile=tile), name) for name in cases]
        except Exception as e:   # out of shared memory or registers
            print(f"tile {tile}: {type(e).__name__}")
            continue
        results.append((row[0][0], row[1][0], tile))
        print(f"tile {tile}{' (default)' if tile == default else ''}: " +
              "  ".join(f"{name} {ms:.3f} ms {tf:.0f} TFLOP/s" for name, (ms, tf) in zip(cases, row)))
    print("fastest on the bench step (ms, ms, tile):", sorted(results)[:3])
    print("fastest on 4 x 4096:", sorted(results, key=lambda r: r[1])[:3])


if __name__ == "__main__":
    main()
