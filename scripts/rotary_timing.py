"""In-graph time of the q/k norm + rotary + KV store kernel, this tree's against another checkout's
(--base DIR), Qwen3-0.6B shape (16 query / 8 KV heads of 128, q/k norm), bf16 and float8 caches.
Each case runs the kernel 16 times over 16 buffer sets in one CUDA graph; us per call. Outputs
are checked against each other (rotated q and k, the cache) before timing.

    PYTHONPATH=. python scripts/rotary_timing.py --base .base2
"""
import argparse

import torch

import nanovllm.kernels.rotary_embedding as here
from nanovllm.kernels.fp8 import FP8_DTYPE
from nanovllm.layers.rotary import RotaryEmbedding
from scripts.base_checkout import load_base_module
from scripts.graph_timing import graph_of, replay_ms

HEADS, KV_HEADS, HEAD_DIM, BLOCK, CALLS = 16, 8, 128, 256, 16


def case(tokens: int, fp8: bool):
    qkv = [torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
           for _ in range(CALLS)]
    blocks = tokens // BLOCK + 2
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.zeros(shape, device="cuda", dtype=FP8_DTYPE if fp8 else torch.bfloat16),
               torch.zeros(shape, device="cuda", dtype=FP8_DTYPE if fp8 else torch.bfloat16)) for _ in range(CALLS)]
    slots = torch.randperm(blocks * BLOCK, device="cuda")[:tokens]
    slots[::7] = -1                                             # padding rows are skipped
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    scales = (torch.tensor([0.05], device="cuda"), torch.tensor([0.04], device="cuda")) if fp8 else (None, None)
    weights = (1 + 0.1 * torch.randn(HEAD_DIM, device="cuda")).to(torch.bfloat16), \
        (1 + 0.1 * torch.randn(HEAD_DIM, device="cuda")).to(torch.bfloat16)
    cos_sin = RotaryEmbedding(HEAD_DIM, 4096, 1e6).cos_sin_cache.cuda()
    return qkv, caches, slots, positions, scales, weights, cos_sin


def run(module, c, i: int, qkv_in: list):
    qkv, caches, slots, positions, scales, weights, cos_sin = c
    q, k, v = qkv_in[i].split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    store = module.KVStore(v, caches[i][0], caches[i][1], slots, *scales)
    return module.apply_rotary(positions, q, k, cos_sin, weights, 1e-6, store)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="an older checkout to compare with")
    args = parser.parse_args()
    base = load_base_module(args.base, "nanovllm/kernels/rotary_embedding.py")
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| cache | tokens | base us | here us | outputs equal |")
    print("| --- | --- | --- | --- | --- |")
    for fp8 in (False, True):
        for tokens in (1, 64, 200, 256, 16384):
            c = case(tokens, fp8)
            outputs = {}
            for name, module in (("base", base), ("here", here)):
                fresh = [x.clone() for x in c[0]]
                run(module, c, 0, fresh)
                outputs[name] = (fresh[0].clone(), c[1][0][0].clone().view(torch.uint8), c[1][0][1].clone().view(torch.uint8))
                for cache in c[1][0]:
                    cache.zero_()
            equal = all(torch.equal(a, b) for a, b in zip(outputs["base"], outputs["here"]))
            times = {}
            for name, module in (("base", base), ("here", here)):
                fresh = [x.clone() for x in c[0]]
                graph, _ = graph_of(lambda: [run(module, c, i, fresh) for i in range(CALLS)])
                times[name] = replay_ms(graph) * 1e3 / CALLS
            print(f"| {'fp8' if fp8 else 'bf16'} | {tokens} | {times['base']:.2f} | {times['here']:.2f} | {equal} |",
                  flush=True)


if __name__ == "__main__":
    main()
