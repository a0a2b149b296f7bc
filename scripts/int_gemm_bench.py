"""The 4-bit weight-only GEMM on the GPU: checked against its torch twin (bfloat16 and float16),
then timed for the projections of a model shape at a few batch sizes against the 16-bit GEMM
(F.linear) and the time it takes to read the weight bytes at --bandwidth.

Each timing replays a CUDA graph of calls that cycle through enough copies of the layer to
overflow the L2 cache, so every call reads its weights from memory, as in a decode step.

    PYTHONPATH=. python scripts/int_gemm_bench.py --config configs/qwen3-8b.json --batch 1 16 256
    PYTHONPATH=. python scripts/int_gemm_bench.py --sweep      # every candidate launch shape too
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from nanovllm.kernels.int_gemm import DECODE_CONFIG, PREFILL_CONFIG, LaunchConfig, int_gemm, int_gemm_ref
from nanovllm.quantization.int_packing import awq_for_gemm, dequantize_awq
from nanovllm.utils.quantized_checkpoint import quantize_awq

L2_BYTES = 50 << 20
CANDIDATES = [LaunchConfig(*shape) for shape in [
    (16, 32, 128, 1, 4, 4, True), (16, 64, 128, 1, 4, 4, True), (16, 32, 256, 1, 4, 3, True),
    (16, 64, 128, 2, 4, 4, True), (16, 64, 128, 4, 4, 4, True), (16, 128, 128, 4, 4, 4, True),
    (16, 64, 256, 4, 4, 3, True), (16, 64, 128, 4, 4, 4, False), (16, 32, 128, 1, 4, 4, False),
    (64, 128, 64, 1, 4, 3, True), (64, 128, 64, 1, 4, 3, False), (128, 128, 64, 1, 8, 3, True),
    (64, 64, 128, 1, 4, 3, True), (128, 256, 64, 1, 8, 3, True)]]


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of one decoder layer's projections, unsharded."""
    h, head = config["hidden_size"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    q, kv, i = config["num_attention_heads"] * head, config["num_key_value_heads"] * head, config["intermediate_size"]
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


def random_layer(k: int, n: int, group_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random packed ints and scales straight on the GPU (quantizing a full-size matrix on the host is slow)."""
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
    scales = (torch.rand(k // group_size, n, device="cuda") * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (k // group_size, n), device="cuda").to(dtype)
    return {"qweight": qweight, "scales": scales, "scaled_zeros": (zeros.float() * scales.float()).to(dtype)}


def graph_time(calls, repeats: int = 20) -> float:
    """Seconds per call: a CUDA graph of `calls` (one pass) replayed `repeats` times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:      # compile and warm up outside the graph
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats / len(calls)


def check(dtype: torch.dtype) -> None:
    """The kernel against its twin on a real AWQ layer, every launch shape, several batch sizes."""
    w = torch.randn(1024, 2048) / 2048 ** 0.5
    t = quantize_awq(w, 128)
    layer = {k: v.cuda() for k, v in awq_for_gemm(t["qweight"], t["qzeros"], t["scales"], dtype).items()}
    weight = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], 128).cuda()
    worst = 0.0
    for m in (1, 5, 16, 17, 100, 256):
        x = torch.randn(m, 2048, device="cuda").to(dtype)
        ref = int_gemm_ref(x, layer["qweight"], layer["scales"], layer["scaled_zeros"], 4, 128)
        exact = x.float() @ weight.t()
        for config in [None] + (CANDIDATES if dtype == torch.bfloat16 else []):
            out = int_gemm(x, layer["qweight"], layer["scales"], layer["scaled_zeros"], 4, 128, config=config)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            worst = max(worst, err)
            assert err < 2e-2, (dtype, m, config, err)
        twin_err = ((ref.float() - exact).abs().max() / exact.abs().max()).item()
    print(f"{dtype}: kernel vs twin, worst max-abs error / max |y| = {worst:.2e} over every shape "
          f"(twin vs float32 weights: {twin_err:.2e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-8b.json")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s of the weight-read floor")
    parser.add_argument("--sweep", action="store_true", help="time every candidate launch shape too")
    args = parser.parse_args()
    for dtype in (torch.bfloat16, torch.float16):
        check(dtype)
    with open(args.config) as f:
        model = json.load(f)
    shapes = projections(model)
    dtype = torch.bfloat16
    totals = {}
    print(f"{'layer':13} {'M':>4} {'int4 us':>8} {'bf16 us':>8} {'floor4 us':>9} {'floor16 us':>10}  best sweep")
    for name, (k, n) in shapes.items():
        bytes4 = k * n // 2 + 2 * 2 * (k // args.group_size) * n
        copies = max(2, min(32, math.ceil(4 * L2_BYTES / bytes4)))
        layers = [random_layer(k, n, args.group_size, dtype) for _ in range(copies)]
        copies16 = max(2, min(16, math.ceil(4 * L2_BYTES / (2 * k * n))))
        weights16 = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies16)]
        for m in args.batch:
            x = torch.randn(m, k, device="cuda", dtype=dtype)

            def calls(config=None):
                return [lambda l=l: int_gemm(x, l["qweight"], l["scales"], l["scaled_zeros"], 4, args.group_size,
                                             config=config) for l in layers]
            t4 = graph_time(calls())
            t16 = graph_time([lambda w=w: F.linear(x, w) for w in weights16])
            best = ""
            if args.sweep:
                timed = sorted((graph_time(calls(c)), c) for c in CANDIDATES)
                best = f"{timed[0][0] * 1e6:7.1f} us {timed[0][1]}, next {timed[1][0] * 1e6:.1f} {timed[1][1]}"
            floor4 = (bytes4 + 2 * m * (k + n)) / args.bandwidth
            floor16 = (2 * k * n + 2 * m * (k + n)) / args.bandwidth
            totals.setdefault(m, [0.0, 0.0, 0.0])
            for i, v in enumerate((t4, t16, floor4)):
                totals[m][i] += v
            print(f"{name:13} {m:4d} {t4 * 1e6:8.1f} {t16 * 1e6:8.1f} {floor4 * 1e6:9.1f} {floor16 * 1e6:10.1f}  {best}")
        del layers, weights16
        torch.cuda.empty_cache()
    layers_n = model["num_hidden_layers"]
    for m, (t4, t16, floor4) in totals.items():
        print(f"one layer's four projections at M={m}: int4 {t4 * 1e6:.1f} us, bf16 {t16 * 1e6:.1f} us, "
              f"int4 floor {floor4 * 1e6:.1f} us (x{layers_n} layers: {layers_n * t4 * 1e3:.2f} ms against "
              f"{layers_n * t16 * 1e3:.2f} ms)")
    print(f"configs: decode (M <= 16) {DECODE_CONFIG}, prefill {PREFILL_CONFIG}")


if __name__ == "__main__":
    main()
