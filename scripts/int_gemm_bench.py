"""The 4-bit weight-only GEMM on the GPU: checked against its torch twin (bfloat16 and float16),
then timed for the projections of a model shape at a few batch sizes against the 16-bit GEMM
(F.linear) and the time it takes to read the weight bytes at --bandwidth.

With --gemv, the few-row weight-streaming float8 kernel instead (fp8_gemv, checked against its twin
first): for FP8 per-channel and FP8 block [128, 128] weights at 1 to 16 rows, time and weight bytes
read per second of the GEMV, of the W8A8 path (activations quantized, then torch._scaled_mm or the
Triton float8 GEMM), and of the bfloat16 GEMM. (A first 4-bit GEMV, unpacking with scalar float
math, lost to int_gemm at every row count: docs/benchmarks.md; --int4-gemv times its successor.)

Each timing replays a CUDA graph of calls that cycle through enough copies of the layer to
overflow the L2 cache, so every call reads its weights from memory, as in a decode step.

    PYTHONPATH=. python scripts/int_gemm_bench.py --config configs/qwen3-8b.json --batch 1 16 256
    PYTHONPATH=. python scripts/int_gemm_bench.py --sweep      # every candidate launch shape too
    PYTHONPATH=. python scripts/int_gemm_bench.py --gemv       # the GEMVs at M = 1, 2, 4, 8, 16
    PYTHONPATH=. python scripts/int_gemm_bench.py --gemv --sweep --batch 1 16   # their launch shapes too
    PYTHONPATH=. python scripts/int_gemm_bench.py --w8a8       # float8 GEMMs at decode batch sizes
    PYTHONPATH=. python scripts/int_gemm_bench.py --w8a8 --sweep --batch 16 64 256   # their transposed tiles too
    PYTHONPATH=. python scripts/int_gemm_bench.py --int4-gemv  # the 4-bit GEMV at M = 1, 2, 4, 8, 16
    PYTHONPATH=. python scripts/int_gemm_bench.py --int4-gemv --sweep --batch 1 16   # its launch shapes too
    PYTHONPATH=. python scripts/int_gemm_bench.py --int4-gemv --sweep --batch 32 64 128 256   # tiles of more rows
    PYTHONPATH=. python scripts/int_gemm_bench.py --int4-gemm --sweep   # the 4-bit GEMM at 17-1,024 rows
    PYTHONPATH=. python scripts/int_gemm_bench.py --tflops    # each format's route in TFLOP/s at 16-256 rows

With --w8a8, the float8 GEMM an FP8 layer runs after quantizing the activations (the route
Fp8LinearMethod.route picks in nanovllm/quantization/fp8.py: the transposed Triton kernel on
decode_tile's tiles up to 256 rows) against torch._scaled_mm with row-wise scales and the plain
Triton kernel, for per-channel and block [128, 128] weights.

With --int4-gemm, the 4-bit GEMM of decode batches (int4_gemm: weights dequantized by packed 16-bit
arithmetic, the matrix cores' register operand), checked against its twin in bfloat16 and float16
first, against int_gemm, the prefills' path (the weight dequantized, then cuBLAS) and the bfloat16
GEMM per projection; --sweep adds its tiles, each with K split in one, two and four.

With --int4-gemv, the few-row 4-bit GEMV (int4_gemv: 16-bit floats built by lop3, summed by the
matrix cores), checked against its twin in bfloat16 and float16 first, against int_gemm and the
bfloat16 GEMM per projection; --sweep adds its launch shapes, each with split K chosen by
PROGRAMS_PER_SM (--programs-per-sm) and with none.
"""
import argparse
import json
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from nanovllm.kernels import fp8_gemv as fp8_gemv_module
from nanovllm.kernels.fp8_primitives import FP8_DTYPE, QuantizedActivation
from nanovllm.kernels.fp8_gemv import GemvConfig, fp8_gemv, fp8_gemv_ref
from nanovllm.kernels.fp8_linear import GemmTile, fp8_matmul, quantize_activation, scaled_mm_per_channel
from nanovllm.kernels import int4_gemv as int4_gemv_module
from nanovllm.kernels.int4_gemm import Int4GemmConfig, int4_gemm
from nanovllm.kernels.int4_gemv import Int4GemvConfig, int4_gemv
from nanovllm.kernels.int_dequantize import dequantized_matmul
from nanovllm.kernels.int_gemm import DECODE_CONFIG, SWAPPED_CONFIGS, LaunchConfig, int_gemm, int_gemm_ref
from nanovllm.kernels.triton_compat import triton
from nanovllm.quantization.fp8 import GEMV_MAX_ROWS, Fp8LinearMethod, in_whole_blocks
from nanovllm.quantization.int_packing import awq_for_gemm, dequantize_awq
from nanovllm.quantization.weight_only import WeightOnlyIntMethod
from nanovllm.checkpoints.quantized_checkpoint import quantize_awq

L2_BYTES = 50 << 20
CANDIDATES = [LaunchConfig(*shape) for shape in [
    (16, 32, 128, 1, 4, 4, True), (16, 64, 128, 1, 4, 4, True), (16, 32, 256, 1, 4, 3, True),
    (16, 64, 128, 2, 4, 4, True), (16, 64, 128, 4, 4, 4, True), (16, 128, 128, 4, 4, 4, True),
    (16, 64, 256, 4, 4, 3, True), (16, 64, 128, 4, 4, 4, False), (16, 32, 128, 1, 4, 4, False),
    (64, 128, 64, 1, 4, 3, True), (64, 128, 64, 1, 4, 3, False), (128, 128, 64, 1, 8, 3, True),
    (64, 64, 128, 1, 4, 3, True), (128, 256, 64, 1, 8, 3, True)]]
# --gemv --sweep: (block_n, block_k, warps, stages) of each GEMV, each with split K chosen by
# PROGRAMS_PER_SM and with none; the one-row and the 16-row shapes of the float8 kernel differ
FP8_ONE_ROW_CANDIDATES = [GemvConfig(*c) for c in [(4, 1024, 4, 1), (4, 1024, 4, 3), (8, 1024, 4, 1), (8, 1024, 4, 3),
                                                   (4, 512, 4, 4), (8, 512, 8, 3), (2, 1024, 2, 3), (8, 256, 2, 6)]]
FP8_FEW_ROWS_CANDIDATES = [GemvConfig(*c) for c in [(16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3),
                                                    (32, 256, 4, 4), (32, 128, 4, 5), (16, 256, 8, 4)]]

# --int4-gemv --sweep: (block_n, block_k, warps, stages)
INT4_GEMV_CANDIDATES = [Int4GemvConfig(*c) for c in [(128, 128, 4, 4), (256, 128, 4, 4), (256, 128, 8, 4),
                                                     (128, 128, 4, 6), (64, 128, 4, 4), (64, 128, 2, 6),
                                                     (256, 128, 4, 6), (512, 128, 8, 4), (128, 128, 8, 4),
                                                     (256, 128, 4, 3), (512, 128, 8, 3)]]

# --int4-gemv --sweep above 16 rows: (block_n, block_k, warps, stages, sub_words, block_m), tiles that
# unpack each weight once for 32-128 rows (issue 48: the 4-bit GEMM from 17 rows)
INT4_TILE_CANDIDATES = [Int4GemvConfig(*c) for c in [
    (64, 128, 4, 3, 16, 32), (128, 128, 4, 3, 16, 32), (256, 128, 8, 3, 16, 32), (64, 128, 4, 3, 16, 64),
    (128, 128, 8, 3, 16, 64), (128, 128, 8, 4, 16, 64), (64, 128, 8, 3, 16, 128), (128, 128, 8, 3, 16, 128)]]

# --int4-gemm --sweep: (block_n, block_m, warps, stages), each with K split in 1, 2 and 4
INT4_GEMM_CANDIDATES = [Int4GemmConfig(*c) for c in [(64, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
                                                     (128, 128, 8, 4), (64, 32, 4, 4), (128, 32, 8, 3),
                                                     (64, 64, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2),
                                                     (128, 64, 8, 2), (64, 128, 8, 3)]]

# --int4-gemv --sweep at one row: (block_n, block_k, warps, stages, sub_words), each also with split
# K at 2, 4, 8, 16 and 32
INT4_ONE_ROW_CANDIDATES = [Int4GemvConfig(*c) for c in [
    (256, 128, 4, 1, 2), (128, 128, 1, 1, 2), (256, 128, 1, 1, 4), (128, 128, 2, 1, 4), (512, 128, 4, 1, 2),
    (512, 128, 8, 1, 2), (64, 128, 2, 1, 16), (128, 128, 4, 1, 16), (64, 128, 1, 1, 2), (128, 128, 1, 1, 4),
    (128, 128, 1, 1, 8), (128, 128, 1, 1, 16), (256, 128, 2, 1, 8), (512, 128, 2, 1, 4), (512, 128, 2, 1, 2),
    (1024, 128, 2, 1, 2)]]


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


def copies_beyond_l2(make, nbytes: int, most: int = 32) -> list:
    """`make()`'s layer of `nbytes` enough times that calls cycling through the copies overflow the
    L2 cache, so each call reads its weights from memory (at least 2, at most `most`)."""
    return [make() for _ in range(max(2, min(most, math.ceil(4 * L2_BYTES / nbytes))))]


def bf16_copies(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """16-bit [n, k] weights for the F.linear baseline, as copies_beyond_l2 makes them."""
    return copies_beyond_l2(lambda: torch.randn(n, k, device="cuda", dtype=dtype), 2 * k * n, most=16)


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


def random_fp8_layer(k: int, n: int, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 [N, K] and float32 scales per row (group_size None) or per row and group, on the GPU,
    each group_size rows repeating their block's scales as a block layout's do."""
    w = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(FP8_DTYPE)
    if group_size is None:
        return w, torch.rand(n, 1, device="cuda") * 1e-3 + 1e-4
    blocks = torch.rand(-(-n // group_size), -(-k // group_size), device="cuda") * 1e-3 + 1e-4
    return w, blocks.repeat_interleave(group_size, 0)[:n]


def chosen_gemm(x_q: torch.Tensor, x_s: torch.Tensor, w: torch.Tensor, s: torch.Tensor, group_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The GEMM an FP8 layer's method runs on activations that come quantized (the route it picks).
    Block scales of the 8B projections lie in whole 128 x 128 blocks, as their layers mark them."""
    whole_blocks = in_whole_blocks((group_size, group_size), 0, w.shape[1], [w.shape[0]])
    return Fp8LinearMethod().multiply(QuantizedActivation(x_q, x_s, dtype), w, s, group_size,
                                      whole_blocks=whole_blocks)


def w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float8 path of an FP8 layer without the GEMV: quantize the activations, then the GEMM."""
    x_q, x_s = quantize_activation(x, group_size)
    return chosen_gemm(x_q, x_s, w, s, group_size, x.dtype)


def check_gemv() -> None:
    """The GEMV against its twin in bfloat16, with and without split K."""
    k, n, group = 1536, 1000, 128
    worst = {"fp8 channel": 0.0, "fp8 block": 0.0}
    fp8 = {"fp8 channel": (random_fp8_layer(k, n, None), k), "fp8 block": (random_fp8_layer(k, n, group), group)}
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for split in (None, 1, 3):
            for name, ((w, s), g) in fp8.items():
                out, ref = fp8_gemv(x, w, s, g, split_k=split).float(), fp8_gemv_ref(x, w, s, g).float()
                worst[name] = max(worst[name], ((out - ref).abs().max() / ref.abs().max()).item())
    print("GEMV kernels vs twins, bfloat16, worst max-abs error / max |y|: "
          + ", ".join(f"{name} {err:.2e}" for name, err in worst.items()))
    assert all(err < 2e-2 for err in worst.values()), worst


def gemv_table(args, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
    """Each format's GEMV against the path it replaces and against bfloat16, per projection and M."""
    dtype = torch.bfloat16
    totals = {}
    print(f"{'format':12} {'layer':13} {'M':>3} {'gemv us':>8} {'GB/s':>6} {'before us':>9} {'GB/s':>6} "
          f"{'bf16 us':>8} {'GB/s':>6} {'speedup':>8}  best sweep")
    for name, (k, n) in shapes.items():
        formats = {   # name -> (bytes of one weight and its scales, a random weight, group size)
            "fp8 channel": (n * k + 4 * n, lambda: random_fp8_layer(k, n, None), k),
            "fp8 block": (n * k + 4 * n * -(-k // 128), lambda: random_fp8_layer(k, n, 128), 128),
        }
        weights16 = bf16_copies(n, k, dtype)
        layers = {fmt: copies_beyond_l2(make, nbytes) for fmt, (nbytes, make, _) in formats.items()}
        for m in args.batch:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            act_bytes = 2 * m * (k + n)
            t16 = graph_time([lambda w=w: F.linear(x, w) for w in weights16])
            for fmt, (nbytes, _, g) in formats.items():
                def gemv(config=None, split=None):
                    return [lambda l=l: fp8_gemv(x, l[0], l[1], g, config=config, split_k=split)
                            for l in layers[fmt]]
                before = [lambda l=l: w8a8(x, l[0], l[1], g) for l in layers[fmt]]
                candidates = FP8_ONE_ROW_CANDIDATES if m == 1 else FP8_FEW_ROWS_CANDIDATES
                t_gemv, t_before = graph_time(gemv()), graph_time(before)
                best = ""
                if args.sweep:
                    timed = sorted([(graph_time(gemv(c, split)), str(tuple(c)), split or "auto")
                                    for c in candidates for split in (None, 1)], key=lambda timing: timing[0])
                    best = ", ".join(f"{t * 1e6:.1f} us {c} split {sp}" for t, c, sp in timed[:2])
                for key, t in (("gemv", t_gemv), ("before", t_before), ("bf16", t16)):
                    totals.setdefault((fmt, m), {}).setdefault(key, 0.0)
                    totals[(fmt, m)][key] += t
                gbs = lambda b, t: (b + act_bytes) / t / 1e9
                print(f"{fmt:12} {name:13} {m:3d} {t_gemv * 1e6:8.1f} {gbs(nbytes, t_gemv):6.0f} "
                      f"{t_before * 1e6:9.1f} {gbs(nbytes, t_before):6.0f} {t16 * 1e6:8.1f} "
                      f"{gbs(2 * k * n, t16):6.0f} {t_before / t_gemv:8.2f}  {best}", flush=True)
        del layers, weights16
        torch.cuda.empty_cache()
    for (fmt, m), t in totals.items():
        print(f"{fmt:12} M={m:<3d} four projections x{num_layers} layers: gemv {num_layers * t['gemv'] * 1e3:.2f} ms, "
              f"before {num_layers * t['before'] * 1e3:.2f} ms, bf16 {num_layers * t['bf16'] * 1e3:.2f} ms")
    print(f"GEMV knobs: {fp8_gemv_module.ONE_ROW_CONFIG} (M=1), {fp8_gemv_module.FEW_ROWS_CONFIG} (M>1); "
          f"PROGRAMS_PER_SM {fp8_gemv_module.PROGRAMS_PER_SM}; GEMV_MAX_ROWS {GEMV_MAX_ROWS}")


def fp8_decode_candidates(m: int) -> list[GemmTile]:
    """Transposed float8 tiles for m tokens, K split 1-6: up to 128 tokens the tokens rounded up to a
    power of two by 64 or 128 features; past 128, tiles of 128 and of 256 tokens."""
    shapes = [(64, 4, 3), (64, 4, 5), (64, 4, 7), (128, 8, 4)]    # (features, warps, stages)
    if m <= 128:
        tiles = [(max(16, triton.next_power_of_2(m)), *shape) for shape in shapes]
    else:
        tiles = [(128, *shape) for shape in shapes] + [(256, 64, 8, 5), (256, 128, 8, 4)]
    return [GemmTile(block_m, block_n, 128, warps, stages, split, True)
            for block_m, block_n, warps, stages in tiles for split in (1, 2, 3, 4, 6)]


def w8a8_table(args, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
    """The GEMM an FP8 layer runs after quantizing (its method's route) against the routes it chooses
    between; --sweep adds the best transposed tiles (fp8_decode_candidates) per-channel."""
    totals = {}
    print(f"{'format':12} {'layer':13} {'M':>4} {'chosen us':>11} {'TB/s':>5} {'_scaled_mm us':>13} "
          f"{'Triton us':>9} {'quantize us':>11}  best sweep")
    for name, (k, n) in shapes.items():
        for fmt, group in (("fp8 channel", None), ("fp8 block", 128)):
            layers = copies_beyond_l2(lambda: random_fp8_layer(k, n, group), n * k)
            g = group or k
            for m in args.batch:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                x_q, x_s = quantize_activation(x, g)
                t = {"gemm": graph_time([lambda l=l: chosen_gemm(x_q, x_s, l[0], l[1], g, x.dtype) for l in layers]),
                     "triton": graph_time([lambda l=l: fp8_matmul(x_q, x_s, l[0], l[1], g, x.dtype) for l in layers]),
                     "quantize": graph_time([lambda: quantize_activation(x, g)] * 8)}
                best = ""
                if group is None:
                    t["scaled_mm"] = graph_time([lambda l=l: scaled_mm_per_channel(x_q, x_s, l[0], l[1], x.dtype)
                                                 for l in layers])
                if group is None and args.sweep:
                    w, s = layers[0]
                    ref = fp8_matmul(x_q, x_s, w, s, g, x.dtype).float()
                    timed = []
                    for tile in fp8_decode_candidates(m):
                        out = fp8_matmul(x_q, x_s, w, s, g, x.dtype, tile=tile).float()
                        assert (out - ref).abs().max() <= 2e-2 * ref.abs().max(), (name, m, tile)
                        timed.append((graph_time([lambda l=l: fp8_matmul(x_q, x_s, l[0], l[1], g, x.dtype, tile=tile)
                                                  for l in layers]), tile))
                    timed.sort(key=lambda timing: timing[0])
                    t["best"] = timed[0][0]
                    best = ", ".join(f"{v * 1e6:.1f} us {tuple(tile)[:2] + tuple(tile)[3:6]}" for v, tile in timed[:6])
                for key, v in t.items():
                    totals.setdefault((fmt, m), {}).setdefault(key, 0.0)
                    totals[(fmt, m)][key] += v
                scaled = f"{t['scaled_mm'] * 1e6:13.1f}" if "scaled_mm" in t else f"{'':13}"
                print(f"{fmt:12} {name:13} {m:4d} {t['gemm'] * 1e6:11.1f} {n * k / t['gemm'] / 1e12:5.2f} {scaled} "
                      f"{t['triton'] * 1e6:9.1f} {t['quantize'] * 1e6:11.1f}  {best}", flush=True)
            del layers
            torch.cuda.empty_cache()
    for (fmt, m), t in sorted(totals.items()):
        print(f"{fmt:12} M={m:<4d} four projections x{num_layers} layers (ms): "
              + ", ".join(f"{key} {v * num_layers * 1e3:.2f}" for key, v in t.items()))


def check_against_twin(name: str, kernel, rows: tuple[int, ...], candidates) -> None:
    """A 4-bit kernel (inline PTX) against its twin on a real AWQ layer: row counts, split K, launch
    shapes (`candidates(m)`, in bfloat16; float16 the default shape). 1040 columns: a partial tile,
    and the sizes' divisibility of the model's, so the timings reuse these compiled kernels."""
    k, n, group = 2048, 1040, 128
    t = quantize_awq(torch.randn(n, k) / k ** 0.5, group)
    for dtype in (torch.bfloat16, torch.float16):
        layer = {key: v.cuda() for key, v in awq_for_gemm(t["qweight"], t["qzeros"], t["scales"], dtype).items()}
        args = (layer["qweight"], layer["scales"], layer["scaled_zeros"])
        worst = 0.0
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = int_gemm_ref(x, *args, 4, group).float()
            for config in [None] + (candidates(m) if dtype == torch.bfloat16 else []):
                for split in (None, 1, 3):
                    out = kernel(x, *args, group, config=config, split_k=split).float()
                    worst = max(worst, ((out - ref).abs().max() / ref.abs().max()).item())
        print(f"{name} vs twin, {dtype}, worst max-abs error / max |y|: {worst:.2e}")
        assert worst < 2e-2, (dtype, worst)


def check_int4_gemv() -> None:
    check_against_twin("int4 GEMV", int4_gemv, (1, 5, 16, 19, 70),
                       lambda m: INT4_ONE_ROW_CANDIDATES if m == 1 else INT4_GEMV_CANDIDATES if m <= 16 else
                       INT4_TILE_CANDIDATES)


def int4_layer_copies(k: int, n: int, group: int, dtype: torch.dtype) -> tuple[list, list, int]:
    """What the 4-bit tables time for one projection: copies of a random 4-bit layer and of a 16-bit
    weight of its shape (copies_beyond_l2), and the 4-bit layer's bytes."""
    nbytes = k * n // 2 + 2 * 2 * (k // group) * n
    return copies_beyond_l2(lambda: random_layer(k, n, group, dtype), nbytes), bf16_copies(n, k, dtype), nbytes


def baseline_times(x: torch.Tensor, layers: list, weights16: list, group: int) -> dict[str, float]:
    """int_gemm and the bfloat16 GEMM on the same rows: what the 4-bit kernels are set against."""
    return {"int_gemm": graph_time([lambda l=l: int_gemm(x, l["qweight"], l["scales"], l["scaled_zeros"], 4, group)
                                    for l in layers]),
            "bf16": graph_time([lambda w=w: F.linear(x, w) for w in weights16])}


def add_to_totals(totals: dict, m: int, times: dict[str, float]) -> None:
    for key, t in times.items():
        totals.setdefault(m, {}).setdefault(key, 0.0)
        totals[m][key] += t


def int4_gemv_table(args, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
    """The 4-bit GEMV against int_gemm and the bfloat16 GEMM, per projection and M."""
    dtype, group = torch.bfloat16, args.group_size
    totals = {}
    print(f"{'layer':13} {'M':>3} {'gemv us':>8} {'GB/s':>6} {'int_gemm us':>11} {'GB/s':>6} {'bf16 us':>8} "
          f"{'speedup':>8}  best sweep")
    for name, (k, n) in shapes.items():
        layers, weights16, bytes4 = int4_layer_copies(k, n, group, dtype)
        for m in args.batch:
            x = torch.randn(m, k, device="cuda", dtype=dtype)

            def gemv(config=None, split=None):
                return [lambda l=l: int4_gemv(x, l["qweight"], l["scales"], l["scaled_zeros"], group,
                                              config=config, split_k=split) for l in layers]
            times = {"gemv": graph_time(gemv()), **baseline_times(x, layers, weights16, group)}
            t_gemv, t_gemm, t16 = times["gemv"], times["int_gemm"], times["bf16"]
            best = ""
            if args.sweep:
                if m == 1:
                    timed = sorted([(graph_time(gemv(c, split)), str(tuple(c)), split or "auto")
                                    for c in INT4_ONE_ROW_CANDIDATES
                                    for split in (None, 2, 4, 8, 16, 32)], key=lambda timing: timing[0])
                else:
                    candidates = INT4_GEMV_CANDIDATES if m <= 16 else INT4_TILE_CANDIDATES
                    timed = sorted([(graph_time(gemv(c, split)), str(tuple(c)), split or "auto")
                                    for c in candidates for split in (None, 1)], key=lambda timing: timing[0])
                best = ", ".join(f"{t * 1e6:.1f} us {c} split {sp}" for t, c, sp in timed[:6])
            add_to_totals(totals, m, times)
            gbs = lambda t: (bytes4 + 2 * m * (k + n)) / t / 1e9
            print(f"{name:13} {m:3d} {t_gemv * 1e6:8.1f} {gbs(t_gemv):6.0f} {t_gemm * 1e6:11.1f} {gbs(t_gemm):6.0f} "
                  f"{t16 * 1e6:8.1f} {t_gemm / t_gemv:8.2f}  {best}", flush=True)
        del layers, weights16
        torch.cuda.empty_cache()
    for m, t in totals.items():
        print(f"M={m:<3d} four projections x{num_layers} layers: int4 gemv {num_layers * t['gemv'] * 1e3:.2f} ms, "
              f"int_gemm {num_layers * t['int_gemm'] * 1e3:.2f} ms, bf16 {num_layers * t['bf16'] * 1e3:.2f} ms")
    print(f"int4 GEMV knobs: {int4_gemv_module.DEFAULT_CONFIG} (M>1), {int4_gemv_module.ONE_ROW_CONFIG} and from "
          f"{int4_gemv_module.WIDE_ONE_ROW_MIN_WEIGHTS} weights {int4_gemv_module.WIDE_ONE_ROW_CONFIG} "
          f"(M=1, {int4_gemv_module.ONE_ROW_WARPS_PER_SM} warps per SM); "
          f"PROGRAMS_PER_SM {fp8_gemv_module.PROGRAMS_PER_SM}; GEMV_MAX_ROWS {int4_gemv_module.GEMV_MAX_ROWS}")


def check_int4_gemm() -> None:
    check_against_twin("int4 GEMM", int4_gemm, (20, 65, 128, 200, 256), lambda m: INT4_GEMM_CANDIDATES)


def int4_gemm_table(args, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
    """The 4-bit GEMM against int_gemm and the bfloat16 GEMM, per projection and M."""
    dtype, group = torch.bfloat16, args.group_size
    totals = {}
    print(f"{'layer':13} {'M':>5} {'gemm us':>8} {'int_gemm us':>11} {'dequantized us':>14} {'bf16 us':>8} "
          f"{'speedup':>8}  best sweep")
    for name, (k, n) in shapes.items():
        layers, weights16, _ = int4_layer_copies(k, n, group, dtype)
        for m in args.batch:
            x = torch.randn(m, k, device="cuda", dtype=dtype)

            def gemm(config=None, split=None):
                return [lambda l=l: int4_gemm(x, l["qweight"], l["scales"], l["scaled_zeros"], group,
                                              config=config, split_k=split) for l in layers]
            t = {"gemm": graph_time(gemm()),
                 "dequantized": graph_time([lambda l=l: dequantized_matmul(x, l["qweight"], l["scales"],
                                                                           l["scaled_zeros"], 4, group) for l in layers]),
                 **baseline_times(x, layers, weights16, group)}
            best = ""
            if args.sweep:
                timed = sorted([(graph_time(gemm(c, split)), str(tuple(c)), split)
                                for c in INT4_GEMM_CANDIDATES for split in (1, 2, 4)], key=lambda timing: timing[0])
                best = ", ".join(f"{tt * 1e6:.1f} us {c} split {sp}" for tt, c, sp in timed[:4])
            add_to_totals(totals, m, t)
            print(f"{name:13} {m:5d} {t['gemm'] * 1e6:8.1f} {t['int_gemm'] * 1e6:11.1f} {t['dequantized'] * 1e6:14.1f} "
                  f"{t['bf16'] * 1e6:8.1f} {t['int_gemm'] / t['gemm']:8.2f}  {best}", flush=True)
        del layers, weights16
        torch.cuda.empty_cache()
    for m, t in totals.items():
        print(f"M={m:<5d} four projections x{num_layers} layers: int4 gemm {num_layers * t['gemm'] * 1e3:.2f} ms, "
              f"int_gemm {num_layers * t['int_gemm'] * 1e3:.2f} ms, dequantized + cuBLAS "
              f"{num_layers * t['dequantized'] * 1e3:.2f} ms, bf16 {num_layers * t['bf16'] * 1e3:.2f} ms")


def tflops_table(args, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
    """Each format's linear method (its route at these rows) in TFLOP/s against bfloat16 cuBLAS, per projection."""
    group, awq, fp8 = args.group_size, WeightOnlyIntMethod(4), Fp8LinearMethod()
    totals = {}
    print(f"{'layer':13} {'M':>4} {'bf16 us':>8} {'TFLOP/s':>7} {'AWQ us':>8} {'TFLOP/s':>7} {'x bf16':>6} "
          f"{'FP8 us':>8} {'TFLOP/s':>7} {'x bf16':>6}")
    for name, (k, n) in shapes.items():
        layers, weights16, _ = int4_layer_copies(k, n, group, torch.bfloat16)
        layers = [SimpleNamespace(**layer, group_size=group, g_idx=None) for layer in layers]
        fp8_layers = copies_beyond_l2(lambda: random_fp8_layer(k, n, None), n * k)
        for m in args.batch:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = {"bf16": graph_time([lambda w=w: F.linear(x, w) for w in weights16]),
                 "awq": graph_time([lambda l=l: awq.apply(l, x) for l in layers]),
                 "fp8": graph_time([lambda l=l: fp8.multiply(x, l[0], l[1], k) for l in fp8_layers])}
            add_to_totals(totals, m, t)
            tflops = {key: 2 * m * n * k / v / 1e12 for key, v in t.items()}
            print(f"{name:13} {m:4d} {t['bf16'] * 1e6:8.1f} {tflops['bf16']:7.0f} {t['awq'] * 1e6:8.1f} "
                  f"{tflops['awq']:7.0f} {t['bf16'] / t['awq']:6.2f} {t['fp8'] * 1e6:8.1f} {tflops['fp8']:7.0f} "
                  f"{t['bf16'] / t['fp8']:6.2f}", flush=True)
        del layers, weights16, fp8_layers
        torch.cuda.empty_cache()
    for m, t in totals.items():
        print(f"M={m:<4d} four projections x{num_layers} layers (ms): "
              + ", ".join(f"{key} {v * num_layers * 1e3:.2f}" for key, v in t.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-8b.json")
    parser.add_argument("--batch", type=int, nargs="+", help="rows (default 1 16 256; with --gemv 1 2 4 8 16)")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--bandwidth", type=float, default=3.0e12, help="bytes/s of the weight-read floor")
    parser.add_argument("--sweep", action="store_true", help="time every candidate launch shape too")
    parser.add_argument("--gemv", action="store_true", help="the few-row GEMVs against the paths before them and bf16")
    parser.add_argument("--programs-per-sm", type=int, help="the GEMVs' split-K target (PROGRAMS_PER_SM)")
    parser.add_argument("--w8a8", action="store_true", help="float8 GEMMs (quantized activations) at decode sizes")
    parser.add_argument("--int4-gemv", action="store_true", help="the 4-bit GEMV against int_gemm and bf16")
    parser.add_argument("--int4-gemm", action="store_true", help="the 4-bit GEMM against int_gemm and bf16")
    parser.add_argument("--tflops", action="store_true", help="each format's route in TFLOP/s beside bf16")
    args = parser.parse_args()
    with open(args.config) as f:
        model = json.load(f)
    shapes = projections(model)
    if args.programs_per_sm:
        fp8_gemv_module.PROGRAMS_PER_SM = args.programs_per_sm
    # mode -> (default rows, the kernels' check against their twins, the timing table)
    modes = {"w8a8": ([16, 32, 64, 96, 128, 160, 192, 224, 256, 512], None, w8a8_table),
             "gemv": ([1, 2, 4, 8, 16], check_gemv, gemv_table),
             "int4_gemv": ([1, 2, 4, 8, 16], check_int4_gemv, int4_gemv_table),
             "int4_gemm": ([17, 32, 64, 128, 240, 384, 1024], check_int4_gemm, int4_gemm_table),
             "tflops": ([16, 64, 128, 256], None, tflops_table)}
    for mode, (rows, check_kernels, table) in modes.items():
        if getattr(args, mode):
            args.batch = args.batch or rows
            if check_kernels:
                check_kernels()
            table(args, shapes, model["num_hidden_layers"])
            return
    args.batch = args.batch or [1, 16, 256]
    for dtype in (torch.bfloat16, torch.float16):
        check(dtype)
    dtype = torch.bfloat16
    totals = {}
    print(f"{'layer':13} {'M':>4} {'int4 us':>8} {'bf16 us':>8} {'floor4 us':>9} {'floor16 us':>10}  best sweep")
    for name, (k, n) in shapes.items():
        bytes4 = k * n // 2 + 2 * 2 * (k // args.group_size) * n
        layers = copies_beyond_l2(lambda: random_layer(k, n, args.group_size, dtype), bytes4)
        weights16 = bf16_copies(n, k, dtype)
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
    print(f"configs: decode (M <= 16) {DECODE_CONFIG}, swapped (up to M) {SWAPPED_CONFIGS}")


if __name__ == "__main__":
    main()
