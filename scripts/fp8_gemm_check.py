"""FP8 GEMMs on the GPU: the Triton kernel against torch._scaled_mm (row-wise scales) and bfloat16
F.linear, for the Qwen3-8B projections at decode and prefill batch sizes; and each against its
torch twin. Decides nanovllm.kernels.fp8_linear.SCALED_MM_PER_CHANNEL.

    python scripts/fp8_gemm_check.py
"""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nanovllm.kernels.fp8_linear import (fp8_matmul, fp8_matmul_ref, quantize_activation, scaled_mm_per_channel)
from nanovllm.quantization.fp8 import quantize_weight_per_row

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def main():
    torch.manual_seed(0)
    print(f"{'layer':8} {'M':>5} {'bf16 us':>8} {'triton ch':>9} {'scaled_mm':>9} {'triton blk':>10}  max rel err (ch, blk)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        w_q, w_s = quantize_weight_per_row(w)
        blocks = w.float().reshape(n, k // 128, 128).abs().amax(-1) / 448
        wb_q = (w.float() / blocks.repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        for m in (1, 16, 64, 256, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_q, x_s = quantize_activation(x, k)
            xb_q, xb_s = quantize_activation(x, 128)
            t_bf16 = do_bench(lambda: F.linear(x, w))
            t_ch = do_bench(lambda: fp8_matmul(x_q, x_s, w_q, w_s, k, torch.bfloat16))
            t_mm = do_bench(lambda: scaled_mm_per_channel(x_q, x_s, w_q, w_s, torch.bfloat16))
            t_blk = do_bench(lambda: fp8_matmul(xb_q, xb_s, wb_q, blocks, 128, torch.bfloat16))
            ref = fp8_matmul_ref(x_q, x_s, w_q, w_s, k, torch.float32)
            refb = fp8_matmul_ref(xb_q, xb_s, wb_q, blocks, 128, torch.float32)
            err = ((fp8_matmul(x_q, x_s, w_q, w_s, k, torch.bfloat16).float() - ref).abs().max() / ref.abs().max()).item()
            errb = ((fp8_matmul(xb_q, xb_s, wb_q, blocks, 128, torch.bfloat16).float() - refb).abs().max()
                    / refb.abs().max()).item()
            print(f"{name:8} {m:5d} {t_bf16 * 1e3:8.1f} {t_ch * 1e3:9.1f} {t_mm * 1e3:9.1f} {t_blk * 1e3:10.1f}  "
                  f"{err:.1e}, {errb:.1e}")


if __name__ == "__main__":
    main()
