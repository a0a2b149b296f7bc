"""Float8 KV cache on a GPU: the kernels against their torch twins in bfloat16, then decode
attention timed with a bfloat16 cache and with a float8 one, and the float8 knobs swept.

Shape: Qwen3-0.6B attention (16 query heads, 8 KV heads, head_dim 128, 256-token blocks),
context lengths uniform in [100, 2048] as in bench.py's decode phase, batch 64 and 256.
Bandwidth counts the K/V bytes the kernel must read (half as many for float8).

    PYTHONPATH=. python scripts/fp8_kernel_check.py [--no-sweep]
"""
import itertools
import sys

import torch
from triton.testing import do_bench

from nanovllm.kernels.fp8 import FP8_DTYPE, dequantize_fp8, kv_scale_from_absmax, quantize_fp8
from nanovllm.kernels.paged_attention import (DECODE_TILE, decode_num_splits, paged_attention_ref,
                                              paged_decode_attention, paged_prefill_attention)
from nanovllm.kernels.rotary_embedding import KVStore, apply_rotary, apply_rotary_ref
from nanovllm.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 256
SCALE = HEAD_DIM ** -0.5


def paged_case(batch: int, seed: int, min_len: int = 100, max_len: int = 2048):
    """bf16 K/V in shuffled blocks, the same K/V stored as float8 with per-layer scales from absmax,
    queries, context lengths and block tables."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (batch,), generator=gen)
    blocks = (lens + BLOCK - 1) // BLOCK
    tables = torch.zeros(batch, int(blocks.max()) + 2, dtype=torch.int64)
    perm = torch.randperm(int(blocks.sum()), generator=gen) + 1   # block 0 stays unused, like the runner's padding
    start = 0
    for i, n in enumerate(blocks.tolist()):
        tables[i, :n] = perm[start:start + n]
        start += n
    shape = (int(blocks.sum()) + 1, BLOCK, KV_HEADS, HEAD_DIM)
    k, v = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k_scale, v_scale = kv_scale_from_absmax(k), kv_scale_from_absmax(v)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") * 2
    return dict(q=q, k=k, v=v, k8=quantize_fp8(k, k_scale), v8=quantize_fp8(v, v_scale), k_scale=k_scale,
                v_scale=v_scale, lens=lens.cuda(), tables=tables.cuda(), tokens=int(lens.sum()))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def check_correctness() -> bool:
    ok = True

    def report(name: str, error: float, bound: float) -> None:
        nonlocal ok
        ok &= error <= bound
        print(f"  {name:62s} {error:.2e} (bound {bound:.0e}) {'ok' if error <= bound else 'FAIL'}")

    print("correctness, bfloat16 queries, float8 cache (relative Frobenius error):")
    c = paged_case(24, seed=0)
    per_head = (torch.rand(KV_HEADS, device="cuda") + 0.5) * c["k_scale"]
    k8h, v8h = quantize_fp8(c["k"], per_head), quantize_fp8(c["v"], per_head)
    cu = torch.arange(25, device="cuda")
    for k8, v8, ks, vs, label in ((c["k8"], c["v8"], c["k_scale"], c["v_scale"], "layer scales"),
                                  (k8h, v8h, per_head, per_head, "head scales")):
        ref = paged_attention_ref(c["q"], k8, v8, cu, c["lens"], c["tables"], SCALE, ks, vs)
        for (tile, warps, stages), splits in itertools.product(((64, 4, 2), (128, 4, 2), (256, 8, 2), (256, 4, 3)),
                                                                (1, 3, 8)):
            out = paged_decode_attention(c["q"], k8, v8, c["lens"], c["tables"], SCALE, num_splits=splits,
                                         tile_tokens=tile, num_warps=warps, num_stages=stages, k_scale=ks, v_scale=vs)
            report(f"decode {label}, tile {tile} warps {warps} stages {stages} splits {splits}",
                   relative_error(out, ref), 2e-2)
        dense = paged_attention_ref(c["q"], c["k"], c["v"], cu, c["lens"], c["tables"], SCALE)
        report(f"decode twin, {label}, against the bf16 cache (storage error)", relative_error(ref, dense), 1e-1)

    lens = c["lens"][:4]   # the first four sequences, each with its last q_len tokens new
    q_lens = torch.minimum(torch.tensor([37, 300, 64, 1], device="cuda"), lens)
    cu_q = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)]).int()
    q = torch.randn(int(cu_q[-1]), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = paged_prefill_attention(q, c["k8"], c["v8"], cu_q, int(q_lens.max()), lens, c["tables"][:4], SCALE,
                                  k_scale=c["k_scale"], v_scale=c["v_scale"])
    ref = paged_attention_ref(q, c["k8"], c["v8"], cu_q, lens, c["tables"][:4], SCALE, c["k_scale"], c["v_scale"])
    report("cached prefill, layer scales", relative_error(out, ref), 2e-2)

    tokens = 300
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    q_, k_, v_ = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    k_before = k_.clone()
    slots = torch.randperm(8 * BLOCK, device="cuda")[:tokens]
    slots[::7] = -1
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    cos_sin = RotaryEmbedding(HEAD_DIM, 4096, 1e6).cos_sin_cache.cuda()
    weights = tuple(torch.randn(HEAD_DIM, device="cuda").bfloat16() for _ in range(2))
    caches = [torch.zeros(8, BLOCK, KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE, device="cuda") for _ in range(4)]
    _, rotated = apply_rotary(positions, q_, k_, cos_sin, weights, 1e-6,
                              KVStore(v_, caches[0], caches[1], slots, per_head, per_head * 0.5))
    apply_rotary_ref(positions, q_.clone(), k_before, cos_sin, weights, 1e-6,
                     KVStore(v_, caches[2], caches[3], slots, per_head, per_head * 0.5))
    valid = slots >= 0
    rows = caches[0].view(-1, KV_HEADS, HEAD_DIM)[slots[valid]]
    same_k = torch.equal(rows.view(torch.uint8), quantize_fp8(rotated[valid], per_head).view(torch.uint8))
    same_v = torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    report("store: keys = quantised rotated keys, bit for bit (1 = differ)", float(not same_k), 0)
    report("store: values = the twin's, bit for bit (1 = differ)", float(not same_v), 0)
    report("store: keys against the twin's (dequantised)",
           relative_error(dequantize_fp8(caches[0], per_head, torch.float32),
                          dequantize_fp8(caches[2], per_head, torch.float32)), 5e-2)   # rounding flips of one step
    return ok


def time_decode(c: dict, fp8: bool, splits: int, **knobs) -> tuple[float, float]:
    k, v = (c["k8"], c["v8"]) if fp8 else (c["k"], c["v"])
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"]) if fp8 else {}
    ms = do_bench(lambda: paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, num_splits=splits,
                                                 **knobs, **scales), warmup=25, rep=100, return_mode="median")
    nbytes = c["tokens"] * KV_HEADS * HEAD_DIM * 2 * k.element_size()
    return ms, nbytes / ms / 1e6


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), f"{sms} SMs, torch {torch.__version__}")
    ok = check_correctness()

    print("\ndecode attention, one layer, default knobs and split heuristic (median of do_bench, host-timed):")
    print("| batch | cache | tile, warps, stages | splits | time | K/V read | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    cases = {batch: paged_case(batch, seed=batch) for batch in (64, 256)}
    for batch, c in cases.items():
        base = None
        for fp8 in (False, True):
            dtype = FP8_DTYPE if fp8 else torch.bfloat16
            splits = decode_num_splits(batch, KV_HEADS, sms, dtype)
            ms, gbs = time_decode(c, fp8, splits)
            base = base or ms
            print(f"| {batch} | {'fp8' if fp8 else 'bf16'} | {DECODE_TILE} | {splits} | {ms * 1e3:.1f} us | "
                  f"{gbs:,.0f} GB/s | {base / ms:.2f}x |")

    if "--no-sweep" not in sys.argv:
        print("\nfloat8 knobs (us, GB/s of float8 bytes); bf16 default for reference above")
        for batch, c in cases.items():
            results = []
            for tile, warps, stages, splits in itertools.product((64, 128, 256), (4, 8), (2, 3, 4), (1, 2, 3, 4, 8)):
                try:
                    ms, gbs = time_decode(c, True, splits, tile_tokens=tile, num_warps=warps, num_stages=stages)
                except Exception as e:   # e.g. out of shared memory
                    print(f"  batch {batch} tile {tile} warps {warps} stages {stages} splits {splits}: {type(e).__name__}")
                    continue
                results.append((ms, gbs, tile, warps, stages, splits))
            results.sort()
            print(f"batch {batch}, best five (tile, warps, stages, splits):")
            for ms, gbs, *knobs in results[:5]:
                print(f"  {tuple(knobs)}: {ms * 1e3:.1f} us, {gbs:,.0f} GB/s")
            by_tile = {}
            for ms, gbs, tile, warps, stages, splits in results:
                by_tile.setdefault((tile, warps, stages), []).append((splits, ms))
            for knobs, row in sorted(by_tile.items()):
                print(f"  {knobs}: " + "  ".join(f"{s} splits {ms * 1e3:6.1f}" for s, ms in sorted(row)))
    print("\ncorrectness:", "all ok" if ok else "FAILURES above")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
