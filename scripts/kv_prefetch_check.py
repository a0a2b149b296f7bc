"""Can the decode step read part of each layer's K/V into L2 while the GEMMs run?

Between two decode attentions a layer runs four GEMMs and a few small kernels; they are bound by
latency and read their 31.5 MB of weights at about 1 TB/s, so the memory has bandwidth to spare
for ~40 us per layer. Here a prefetch kernel on a side stream, forked after one attention and
joined before the next, issues `cp.async.bulk.prefetch.L2` for the first tile of the first
sequences of the next layer's cache: the tiles the first wave of attention programs reads first.

Each variant is one CUDA graph over 16 layers of Qwen3-0.6B shapes (distinct weights; 4 distinct
paged caches, contexts uniform in [100, 2048]); us per layer. The attention outputs are checked
against the variant without prefetch (a prefetch changes no data).

    PYTHONPATH=. python scripts/kv_prefetch_check.py
"""
import torch
import torch.nn.functional as F

import nanovllm.kernels.paged_attention as attention
from nanovllm.kernels.silu_and_mul import silu_and_mul
from nanovllm.kernels.triton_compat import tl, triton
from scripts.fp8_kernel_check import KV_HEADS, SCALE, paged_case
from scripts.graph_timing import graph_of, replay_ms

LAYERS, CASES = 16, 4
HIDDEN, Q_SIZE, INTER = 1024, 2048, 3072
CHUNK = 16384          # bytes per bulk prefetch
PREFETCHES = ((16, 256 << 10), (48, 256 << 10), (96, 256 << 10), (48, 512 << 10))   # (sequences, bytes each)


@triton.jit
def _prefetch_first_tiles(k_ptr, v_minus_k, tables_ptr, stride_bt, block_bytes, CHUNKS: tl.constexpr):
    """Program (seq, cache): the first CHUNKS * 16 KB of the sequence's first block of K or V."""
    seq, which = tl.program_id(0), tl.program_id(1)
    block = tl.load(tables_ptr + seq * stride_bt).to(tl.int64)
    base = k_ptr + which * v_minus_k + block * block_bytes
    chunks = base + tl.arange(0, CHUNKS).to(tl.int64) * 16384
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 16384; mov.u32 $0, 0;", "=r,l",
                              [chunks], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(case: dict, k: torch.Tensor, v: torch.Tensor, num_seqs: int, bytes_per_seq: int) -> None:
    k8 = k.view(torch.uint8)
    block_bytes = k8.stride(0)
    _prefetch_first_tiles[(num_seqs, 2)](k8, v.data_ptr() - k.data_ptr(), case["tables"], case["tables"].stride(0),
                                         block_bytes, CHUNKS=min(bytes_per_seq, block_bytes) // CHUNK, num_warps=1)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = [dict(qkv=torch.randn(4096, HIDDEN), o=torch.randn(HIDDEN, Q_SIZE), gate_up=torch.randn(2 * INTER, HIDDEN),
                    down=torch.randn(HIDDEN, INTER)) for _ in range(LAYERS)]
    weights = [{name: (w * 0.02).to("cuda", torch.bfloat16) for name, w in layer.items()} for layer in weights]
    side = torch.cuda.Stream()
    print("| batch | cache | splits | no prefetch | " + " | ".join(f"{n} seqs x {b >> 10} KB" for n, b in PREFETCHES)
          + " | outputs equal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for batch in (16, 64, 128, 256):
        cases = [paged_case(batch, seed=batch * 10 + i) for i in range(CASES)]
        for fp8 in (False, True):
            caches = [(c["k8"], c["v8"], dict(k_scale=c["k_scale"], v_scale=c["v_scale"])) if fp8 else
                      (c["k"], c["v"], {}) for c in cases]
            splits = attention.decode_num_splits(batch, KV_HEADS, sms, caches[0][0].dtype)
            x0 = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)

            def layers(num_seqs: int, bytes_per_seq: int):
                x, outs = x0, []
                main_stream = torch.cuda.current_stream()
                for i, w in enumerate(weights):
                    c, (k, v, scales) = cases[i % CASES], caches[i % CASES]
                    if num_seqs:                      # fork: the prefetch runs beside the GEMMs
                        forked = torch.cuda.Event()
                        forked.record(main_stream)
                        side.wait_event(forked)
                        with torch.cuda.stream(side):
                            prefetch(c, k, v, min(num_seqs, batch), bytes_per_seq)
                        done = torch.cuda.Event()
                        done.record(side)
                    F.linear(x, w["qkv"])
                    if num_seqs:
                        main_stream.wait_event(done)
                    out = attention.paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, splits,
                                                           **scales)
                    outs.append(out)
                    h = F.linear(out.view(batch, Q_SIZE), w["o"])
                    x = F.linear(silu_and_mul(F.linear(h, w["gate_up"])), w["down"])
                return outs

            times, results = [], []
            for num_seqs, bytes_per_seq in ((0, 0), *PREFETCHES):
                graph, outs = graph_of(lambda: layers(num_seqs, bytes_per_seq))
                times.append(replay_ms(graph) * 1e3 / LAYERS)
                torch.cuda.synchronize()
                results.append(torch.stack(outs))
                del graph
            same = all(torch.equal(r, results[0]) for r in results)
            print(f"| {batch} | {'fp8' if fp8 else 'bf16'} | {splits} | " + " | ".join(f"{t:.1f}" for t in times)
                  + f" | {same} |", flush=True)


if __name__ == "__main__":
    main()
