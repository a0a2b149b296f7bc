"""The decode attention kernel of this tree against an older checkout's, both in CUDA graphs as the
decode step replays them, for a bfloat16 and a float8 cache at the engine's split choice; then this
tree's kernel at every split count from batch 16 to 128. Checks every output against the torch twin.

Shape: Qwen3-0.6B attention (16 query / 8 KV heads of 128, 256-token blocks), contexts uniform in
[100, 2048]. Each graph holds 16 calls cycling over 4 distinct caches, so that no call finds its
K/V in L2 from the call before.

    PYTHONPATH=. python scripts/decode_kernel_ab.py [BASE_DIR]   # without BASE_DIR: the split sweep only
"""
import sys

import torch

import nanovllm.kernels.paged_attention as engine
from nanovllm.kernels.fp8 import FP8_DTYPE
from scripts.base_checkout import load_base_module
from scripts.fp8_kernel_check import HEAD_DIM, KV_HEADS, SCALE, paged_case, relative_error
from scripts.graph_timing import graph_of, replay_ms

CALLS, CASES = 16, 4
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)


def cache_of(c: dict, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A case's K and V caches in the given storage, and the scales a float8 one needs."""
    if fp8:
        return c["k8"], c["v8"], dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
    return c["k"], c["v"], {}


def time_in_graph(module, cases: list[dict], fp8: bool, splits: int, **knobs) -> tuple[float, float]:
    """(us per call, relative error of the first call against the twin)."""
    def call(c):
        k, v, scales = cache_of(c, fp8)
        return module.paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, num_splits=splits,
                                             **knobs, **scales)

    graph, outs = graph_of(lambda: [call(cases[i % len(cases)]) for i in range(CALLS)])
    graph.replay()
    torch.cuda.synchronize()
    c = cases[0]
    k, v, scales = cache_of(c, fp8)
    ref = engine.paged_attention_ref(c["q"], k, v, torch.arange(len(c["lens"]) + 1, device="cuda"), c["lens"],
                                     c["tables"], SCALE, **scales)
    return replay_ms(graph) * 1e3 / CALLS, relative_error(outs[0], ref)


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), torch.__version__)
    if len(sys.argv) > 1:
        compare_with_base(load_base_module(sys.argv[1], "nanovllm/kernels/paged_attention.py"), sms)
    sweep_splits(sms)


def compare_with_base(base, sms: int) -> None:
    print("| batch | cache | splits | base | this tree | change | K/V read now | error base / now |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in (16, 64, 128, 256):
        cases = [paged_case(batch, seed=batch * 10 + i) for i in range(CASES)]
        tokens = cases[0]["tokens"]
        for fp8 in (True, False):
            splits = engine.decode_num_splits(batch, KV_HEADS, sms, FP8_DTYPE if fp8 else torch.bfloat16)
            rows = []
            for module in (base, engine, base, engine):   # alternating, twice
                rows.append(time_in_graph(module, cases, fp8, splits))
            base_us = min(rows[0][0], rows[2][0])
            now_us = min(rows[1][0], rows[3][0])
            nbytes = tokens * KV_HEADS * HEAD_DIM * 2 * (1 if fp8 else 2)
            print(f"| {batch} | {'fp8' if fp8 else 'bf16'} | {splits} | {rows[0][0]:.1f} / {rows[2][0]:.1f} us "
                  f"| {rows[1][0]:.1f} / {rows[3][0]:.1f} us | {base_us / now_us - 1:+.1%} "
                  f"| {nbytes / now_us / 1e3:,.0f} GB/s | {rows[0][1]:.1e} / {rows[1][1]:.1e} |", flush=True)


def sweep_splits(sms: int) -> None:
    print("\nthis tree: us per call in a graph by context splits")
    print("| batch | cache | " + " | ".join(map(str, SPLITS)) + " | the engine's choice |")
    print("| --- | --- | " + " | ".join("---" for _ in SPLITS) + " | --- |")
    for batch in (16, 32, 48, 64, 96, 128):
        cases = [paged_case(batch, seed=batch * 10 + i) for i in range(CASES)]
        for fp8 in (True, False):
            chosen = engine.decode_num_splits(batch, KV_HEADS, sms, FP8_DTYPE if fp8 else torch.bfloat16)
            us = {s: time_in_graph(engine, cases, fp8, s)[0] for s in sorted({*SPLITS, chosen})}
            print(f"| {batch} | {'fp8' if fp8 else 'bf16'} | {' | '.join(f'{us[s]:.1f}' for s in SPLITS)} "
                  f"| {chosen}: {us[chosen]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
