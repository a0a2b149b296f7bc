"""Sweep the decode attention kernel's tile, warps, pipeline stages and context splits on the
Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128, bf16, 256-token blocks),
with context lengths drawn uniformly from [200, 2000] as in bench.py's decode phase.

    PYTHONPATH=. python scripts/tune_decode_attention.py
"""
import itertools

import torch
from triton.testing import do_bench

from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256


def case(batch: int, generator: torch.Generator):
    lens = torch.randint(200, 2001, (batch,), generator=generator)
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


def main():
    generator = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = case(256, generator)
    results = []
    for tile, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
        ms, gbs = bandwidth(*big, num_splits=1, tile_tokens=tile, num_warps=warps, num_stages=stages)
        results.append((gbs, tile, warps, stages))
    results.sort(reverse=True)
    print("batch 256, 1 split: best (GB/s, tile, warps, stages):", results[:5], " worst:", results[-1])
    _, tile, warps, stages = results[0]
    print(f"\nsplits sweep with tile {tile}, warps {warps}, stages {stages} (GB/s); current heuristic marked *")
    for batch in (1, 8, 32, 64, 128, 256):
        inputs = case(batch, generator)
        chosen = decode_num_splits(batch, KV_HEADS, sms)
        row = []
        for splits in (1, 2, 4, 8, 16):
            _, gbs = bandwidth(*inputs, num_splits=splits, tile_tokens=tile, num_warps=warps, num_stages=stages)
            row.append(f"{splits}{'*' if splits == chosen else ''}: {gbs:6.0f}")
        print(f"batch {batch:3d}: " + "  ".join(row))


if __name__ == "__main__":
    main()
