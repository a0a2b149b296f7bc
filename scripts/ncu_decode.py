"""Launch one decode attention kernel a few times, for Nsight Compute to read its counters: why does
the float8 kernel read at 2.4 TB/s where the bfloat16 one reads at 2.9? Batch 256, Qwen3-0.6B
attention (16 query / 8 KV heads of 128), contexts uniform in [100, 2048], one context split.

    ncu --clock-control none -k regex:decode --launch-skip 2 --launch-count 1 --section ... \\
        python scripts/ncu_decode.py VARIANT

VARIANT: fp8 (the engine's kernel), bf16, fp8-vt (values stored token-last, scripts/v_layout_check.py),
fp8-where (values converted before the transpose, scripts/decode_regs_check.py).
"""
import sys

import torch

import nanovllm.kernels.paged_attention as pa
from scripts.fp8_kernel_check import SCALE, paged_case, relative_error


def main() -> None:
    variant = sys.argv[1]
    c = paged_case(256, seed=256)
    cu = torch.arange(257, device="cuda")
    fp8 = variant.startswith("fp8")
    k, v = (c["k8"], c["v8"]) if fp8 else (c["k"], c["v"])
    scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"]) if fp8 else {}
    if variant == "fp8-vt":
        from scripts.v_layout_check import decode_vt
        vt = v.permute(0, 2, 3, 1).contiguous()
        fn = lambda: decode_vt(c["q"], k, vt, c["lens"], c["tables"], c["k_scale"], c["v_scale"], 128, 4, 2, 0)
    else:
        module = pa
        if variant == "fp8-where":
            from scripts.decode_regs_check import where_variant
            module = where_variant()
        fn = lambda: module.paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, num_splits=1, **scales)
    ref = pa.paged_attention_ref(c["q"], k, v, cu, c["lens"], c["tables"], SCALE, **scales)
    print(variant, "relative error", relative_error(fn(), ref))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    nbytes = c["tokens"] * 8 * 128 * 2 * k.element_size()
    print(f"K/V bytes {nbytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
