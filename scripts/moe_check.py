"""Qwen3-MoE on a GPU: correctness, then the fused MoE kernel's time against its torch twin.

    python scripts/moe_check.py            # both parts
    python scripts/moe_check.py --no-tests # timings only
    python scripts/moe_check.py --sweep    # also try other tiles at each batch size

1. The MoE tests on CUDA: kernel against twin at every dtype (bfloat16 too), the MoE block against
   transformers, and the engine on tiny Qwen3-MoE checkpoints (the CUDA path, so the Triton kernel)
   giving the same greedy ids as a plain transformers loop.
2. The Qwen3-30B-A3B expert shapes (128 experts, top-8, hidden 2048, moe_intermediate 768, one
   layer, bfloat16): time per call of `fused_moe` and `fused_moe_ref` at decode batch 1..256 and at
   prefill sizes, the kernel's error against the twin, and the bandwidth it reaches on the expert
   weights it must read (each expert some token chose: 3 * 2048 * 768 * 2 bytes).
"""
import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from nanovllm.kernels.fused_moe import MoeTile, choose_tile, fused_moe, fused_moe_ref  # noqa: E402
from nanovllm.layers.moe import route  # noqa: E402

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PREFILL_BATCHES = [1024, 4096, 16384]
SWEEP_TILES = [MoeTile(16, 64, 128, 4, 3), MoeTile(16, 128, 64, 4, 4), MoeTile(16, 64, 64, 4, 5),
               MoeTile(32, 64, 128, 4, 3), MoeTile(32, 128, 64, 4, 4), MoeTile(64, 128, 64, 8, 3),
               MoeTile(64, 64, 64, 4, 4), MoeTile(128, 128, 64, 8, 3)]


def run_tests() -> int:
    command = [sys.executable, "-m", "pytest", "-q", "tests/test_moe_kernel.py", "tests/test_moe_layer.py",
               "tests/test_moe_engine.py"]
    print("$", " ".join(command), flush=True)
    return subprocess.call(command)


def time_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=200)


def expert_inputs(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=generator).to(dtype)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda", generator=generator) / HIDDEN ** 0.5).to(dtype)
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, device="cuda", generator=generator) / INTERMEDIATE ** 0.5).to(dtype)
    router_logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=generator)
    weights, ids = route(router_logits, TOP_K, norm_topk_prob=True)
    return x, w13, w2, weights.to(dtype), ids


def benchmark(sweep: bool) -> None:
    dtype = torch.bfloat16
    print(f"\nfused MoE, Qwen3-30B-A3B experts (E={NUM_EXPERTS}, top-{TOP_K}, H={HIDDEN}, I={INTERMEDIATE}), "
          f"{dtype}, one layer, {torch.cuda.get_device_name()}")
    print(f"{'tokens':>7} {'experts hit':>11} {'tile (m,n,k,w,s)':>18} {'kernel ms':>10} {'twin ms':>9} "
          f"{'speedup':>8} {'weights GB/s':>12} {'max |err|':>10}")
    expert_bytes = 3 * HIDDEN * INTERMEDIATE * dtype.itemsize
    for num_tokens in DECODE_BATCHES + PREFILL_BATCHES:
        x, w13, w2, weights, ids = expert_inputs(num_tokens, dtype)
        hit = len(ids.unique())
        tile = choose_tile(num_tokens, TOP_K, NUM_EXPERTS)
        out = fused_moe(x, w13, w2, weights, ids)
        ref = fused_moe_ref(x, w13, w2, weights, ids)
        error = float((out.float() - ref.float()).abs().max())
        kernel = time_ms(lambda: fused_moe(x, w13, w2, weights, ids))
        twin = time_ms(lambda: fused_moe_ref(x, w13, w2, weights, ids))
        print(f"{num_tokens:>7} {hit:>11} {str(vars_of(tile)):>18} {kernel:>10.4f} {twin:>9.4f} "
              f"{twin / kernel:>7.1f}x {hit * expert_bytes / kernel / 1e6:>12.0f} {error:>10.4f}", flush=True)
        if sweep:
            for other in SWEEP_TILES:
                if other == tile:
                    continue
                try:
                    ms = time_ms(lambda: fused_moe(x, w13, w2, weights, ids, tile=other))
                except Exception as exc:  # a tile too large for shared memory
                    print(f"{'':>7} {'':>11} {str(vars_of(other)):>18} {type(exc).__name__}")
                    continue
                print(f"{'':>7} {'':>11} {str(vars_of(other)):>18} {ms:>10.4f}")
        del x, w13, w2
        torch.cuda.empty_cache()


def vars_of(tile: MoeTile) -> tuple[int, ...]:
    return tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-tests", action="store_true", help="skip the correctness tests")
    parser.add_argument("--sweep", action="store_true", help="time other tiles at each size too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_check.py needs a CUDA device")
    failed = 0 if args.no_tests else run_tests()
    benchmark(args.sweep)
    sys.exit(failed)


if __name__ == "__main__":
    main()
