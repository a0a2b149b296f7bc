"""Decode attention with the register budget per thread capped (Triton's maxnreg), float8 cache,
batch 64 and 256, query groups of 2 (Qwen3-0.6B) and 4 (Qwen3-8B): does occupancy bound the float8
kernel? (193 registers per thread at the (128, 4, 2) tile allow 2 programs per SM; 168 allow 3,
128 allow 4.) The variant that converted values before the shared-memory transpose, measured
with it (docs/benchmarks.md), no longer applies: the kernel now reads float8 values in 16-bit words.

    PYTHONPATH=. python scripts/decode_regs_check.py [--wide]
"""
import sys

import torch
from triton.testing import do_bench

import nanovllm.kernels.paged_attention as pa
from scripts.fp8_kernel_check import SCALE, paged_case, relative_error, HEAD_DIM, KV_HEADS


HEADS = (16, 32)
TILES = ((128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 4, 3), (128, 8, 2))
REGISTERS = (None, 168, 128)


def main() -> None:
    global HEADS, TILES, REGISTERS
    if "--wide" in sys.argv:   # tiles with as many bytes as a 16-bit (128, 4, 2) tile, on 8 warps
        HEADS, REGISTERS = (16,), (None, 168, 128, 112, 96)
        TILES = ((128, 4, 2), (256, 8, 2), (256, 8, 3), (128, 8, 2), (128, 8, 3))
    print(torch.cuda.get_device_name(), torch.__version__)
    pa_defaults = pa.FP8_DECODE_MAX_REGISTERS
    for batch in (64, 256):
        c = paged_case(batch, seed=batch)
        cu = torch.arange(batch + 1, device="cuda")
        for heads in HEADS:
            q = torch.randn(batch, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda") * 2
            k, v = c["k8"], c["v8"]
            scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
            ref = pa.paged_attention_ref(q, k, v, cu, c["lens"], c["tables"], SCALE, **scales)
            nbytes = c["tokens"] * KV_HEADS * HEAD_DIM * 2 * k.element_size()
            for tile in TILES:
                for nreg in REGISTERS:
                    pa.FP8_DECODE_MAX_REGISTERS = nreg   # None: the compiler's choice
                    fn = lambda: pa.paged_decode_attention(q, k, v, c["lens"], c["tables"], SCALE, num_splits=1,
                                                           tile_tokens=tile[0], num_warps=tile[1],
                                                           num_stages=tile[2], **scales)
                    try:
                        err = relative_error(fn(), ref)
                        ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                    except Exception as e:
                        print(f"| {batch} | {heads} | {tile} | {nreg} | {type(e).__name__} |")
                        continue
                    print(f"| {batch} | {heads} | {tile} | {nreg} | {ms * 1e3:.1f} us | "
                          f"{nbytes / ms / 1e6:,.0f} GB/s | {err:.1e} |", flush=True)
            pa.FP8_DECODE_MAX_REGISTERS = pa_defaults


if __name__ == "__main__":
    main()
