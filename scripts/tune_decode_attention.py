"""Sweep the decode attention kernel's tile, warps, pipeline stages and context splits on the
Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128, bf16, 256-token blocks),
with context lengths drawn uniformly from [200, 2000] as in bench.py's decode phase; and time two
orders of the programs, and a batch with its sequences sorted longest first.

    PYTHONPATH=. python scripts/tune_decode_attention.py [--orders]   # --orders: the program-order comparison only
"""
import itertools
import sys

import torch
from triton.testing import do_bench

from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256


def case(batch: int, generator: torch.Generator, longest_first: bool = False):
    lens = torch.randint(200, 2001, (batch,), generator=generator)
    if longest_first:
        lens = lens.sort(descending=True).values
    blocks = (lens + BLOCK - 1) // BLOCK
    tables = torch.zeros(batch, int(blocks.max()), dtype=torch.int64)
    perm = torch.randperm(int(blocks.sum()), generator=generator)
    start = 0
    for i, n in enumerate(blocks.tolist()):
        tables[i, :n] = perm[start:start + n]
        start += n
    k = torch.randn(int(blocks.sum()), BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    return q, k, torch.randn_like(k), lens.cuda(), tables.cuda(), int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * 2


def bandwidth(q, k, v, lens, tables, nbytes, **knobs) -> tuple[float, float]:
    ms = do_bench(lambda: paged_decode_attention(q, k, v, lens, tables, HEAD_DIM ** -0.5, **knobs),
                  warmup=25, rep=100, return_mode="median")
    return ms, nbytes / ms / 1e6


def compare_program_orders(sms: int, **knobs) -> None:
    print("program order: sequences fastest vs KV heads fastest (GB/s, heuristic splits, two runs each)")
    for batch in (16, 64, 128, 192, 256):
        inputs = case(batch, torch.Generator().manual_seed(11))
        splits = decode_num_splits(batch, KV_HEADS, sms)
        by_seq = [bandwidth(*inputs, num_splits=splits, heads_fastest=False, **knobs)[1] for _ in range(2)]
        by_head = [bandwidth(*inputs, num_splits=splits, heads_fastest=True, **knobs)[1] for _ in range(2)]
        print(f"batch {batch:3d}: sequences fastest {by_seq[0]:5.0f} {by_seq[1]:5.0f}  "
              f"heads fastest {by_head[0]:5.0f} {by_head[1]:5.0f}")


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if "--orders" in sys.argv:
        compare_program_orders(sms)
        return
    big, mid = case(256, torch.Generator().manual_seed(0)), case(64, torch.Generator().manual_seed(1))
    results = []
    for tile, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3, 4)):
        try:
            _, gbs = bandwidth(*big, num_splits=1, tile_tokens=tile, num_warps=warps, num_stages=stages)
            _, gbs_mid = bandwidth(*mid, num_splits=2, tile_tokens=tile, num_warps=warps, num_stages=stages)
        except Exception as e:   # e.g. out of shared memory
            print(f"tile {tile} warps {warps} stages {stages}: {type(e).__name__}")
            continue
        results.append((gbs, gbs_mid, tile, warps, stages))
        print(f"tile {tile:3d} warps {warps} stages {stages}: batch 256 {gbs:6.0f} GB/s, batch 64 (2 splits) {gbs_mid:6.0f} GB/s")
    results.sort(reverse=True)
    print("best at batch 256 (GB/s 256, GB/s 64, tile, warps, stages):", results[:3])
    best_mid = max(results, key=lambda r: r[1])
    print("best at batch 64:", best_mid)

    for _, _, tile, warps, stages in {results[0][2:]: results[0], best_mid[2:]: best_mid}.values():
        knobs = dict(tile_tokens=tile, num_warps=warps, num_stages=stages)
        print(f"\nsplits sweep, tile {tile} warps {warps} stages {stages} (GB/s); current heuristic marked *")
        for batch in (1, 4, 16, 32, 48, 64, 96, 128, 192, 256):
            inputs = case(batch, torch.Generator().manual_seed(batch))
            chosen = decode_num_splits(batch, KV_HEADS, sms)
            row = []
            for splits in (1, 2, 3, 4, 6, 8, 12, 16):
                _, gbs = bandwidth(*inputs, num_splits=splits, **knobs)
                row.append(f"{splits}{'*' if splits == chosen else ' '}: {gbs:5.0f}")
            print(f"batch {batch:3d}: " + "  ".join(row))
        compare_program_orders(sms, **knobs)
        print("order of sequences: random vs longest first (GB/s, heuristic splits)")
        for batch in (64, 128, 256):
            splits = decode_num_splits(batch, KV_HEADS, sms)
            _, shuffled = bandwidth(*case(batch, torch.Generator().manual_seed(7)), num_splits=splits, **knobs)
            _, ordered = bandwidth(*case(batch, torch.Generator().manual_seed(7), True), num_splits=splits, **knobs)
            print(f"batch {batch:3d}: random {shuffled:5.0f}  longest first {ordered:5.0f}")


if __name__ == "__main__":
    main()
