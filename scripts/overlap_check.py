"""Can a decode step hide its latency-bound kernels under attention? Two half batches on two streams,
Qwen3-0.6B decoder layers, H100.

In a decode step at batch 64 and up, attention reads the KV cache at close to the memory's speed,
while the rest of a layer (RMSNorm, the four GEMMs, rotary, SiLU-and-mul: "the chain") runs
kernels that are bound by their own latency, not by bandwidth. Split the batch in two halves A and
B: B's chain can run while A's attention runs, and the other way round. Measured here, every
variant in one CUDA graph over LAYERS layers (distinct weights, one shared paged cache), replay
time / LAYERS:

    whole     the engine today: the whole batch, one stream
    halves    A's layer, then B's layer, one stream (what splitting costs by itself)
    free      A and B each on their own stream, B starting once A's first chain is done
    pipe      attention of both halves on one stream, the chains on another, in the order
              attn A(i) | chain B, attn B(i) | chain A, ... (events between them)
    pipe-hi   as pipe, the chain stream at high priority (its programs are scheduled first)

Every variant's output is checked against `whole` (the GEMMs of a half batch may round apart).

    PYTHONPATH=. python scripts/overlap_check.py
"""
import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8 import kv_scale_from_absmax, quantize_fp8
from nanovllm.kernels.paged_attention import decode_num_splits, paged_decode_attention
from nanovllm.kernels.rms_norm import rms_norm
from nanovllm.kernels.rotary_embedding import KVStore, apply_rotary
from nanovllm.kernels.silu_and_mul import silu_and_mul
from nanovllm.layers.rotary import RotaryEmbedding
from scripts.graph_timing import graph_of, replay_ms

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 1024, 16, 8, 128, 3072
BLOCK, EPS, LAYERS = 256, 1e-6, 16
BATCHES = (64, 128, 256)
DEVICE = "cuda"


class Layers:
    """LAYERS decoder layers' weights and a paged cache holding BATCH sequences of 100 to 2048 tokens."""

    def __init__(self, batch: int, fp8: bool):
        gen = torch.Generator().manual_seed(batch)
        w = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16) * 0.02
        self.layers = [dict(qkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), o=w(HIDDEN, HEADS * HEAD_DIM),
                            gate_up=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER),
                            norm_in=1 + w(HIDDEN), norm_post=1 + w(HIDDEN), q_norm=1 + w(HEAD_DIM),
                            k_norm=1 + w(HEAD_DIM)) for _ in range(LAYERS)]
        lens = torch.randint(100, 2049, (batch,), generator=gen)     # context after this step's token
        blocks = (lens + BLOCK - 1) // BLOCK
        self.tables = torch.zeros(batch, int(blocks.max()), dtype=torch.int64)
        perm = torch.randperm(int(blocks.sum()), generator=gen)
        start = 0
        for i, n in enumerate(blocks.tolist()):
            self.tables[i, :n] = perm[start:start + n]
            start += n
        pos = lens - 1
        self.slots = (self.tables.gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK).to(DEVICE)
        self.tables, self.lens, self.positions = self.tables.to(DEVICE), lens.to(DEVICE), pos.to(DEVICE)
        shape = (int(blocks.sum()), BLOCK, KV_HEADS, HEAD_DIM)
        k, v = (torch.randn(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        if fp8:
            self.k_scale, self.v_scale = kv_scale_from_absmax(k), kv_scale_from_absmax(v)
            self.k_cache, self.v_cache = quantize_fp8(k, self.k_scale), quantize_fp8(v, self.v_scale)
            del k, v
        else:
            self.k_scale = self.v_scale = None
            self.k_cache, self.v_cache = k, v
        self.cos_sin = RotaryEmbedding(HEAD_DIM, 4096, 1e6).cos_sin_cache.to(DEVICE)
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.x = torch.randn(batch, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
        self.batch = batch

    def chain_in(self, i: int, h: torch.Tensor, residual: torch.Tensor, rows: slice) -> torch.Tensor:
        """Input norm (adding h to the residual), qkv, q/k norm + rotary + KV store: the queries."""
        w = self.layers[i]
        normed, _ = rms_norm(h, w["norm_in"], EPS, residual)
        qkv = F.linear(normed, w["qkv"]).view(h.shape[0], -1, HEAD_DIM)
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        store = KVStore(v, self.k_cache, self.v_cache, self.slots[rows], self.k_scale, self.v_scale)
        q, _ = apply_rotary(self.positions[rows], q, k, self.cos_sin, (w["q_norm"], w["k_norm"]), EPS, store)
        return q

    def attention(self, q: torch.Tensor, rows: slice) -> torch.Tensor:
        n = q.shape[0]
        splits = decode_num_splits(n, KV_HEADS, self.num_sms, self.k_cache.dtype)
        return paged_decode_attention(q, self.k_cache, self.v_cache, self.lens[rows], self.tables[rows],
                                      HEAD_DIM ** -0.5, splits, k_scale=self.k_scale, v_scale=self.v_scale)

    def chain_out(self, i: int, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o projection, post-attention norm (adding to the residual), the MLP."""
        w = self.layers[i]
        h = F.linear(o.view(o.shape[0], -1), w["o"])
        normed, _ = rms_norm(h, w["norm_post"], EPS, residual)
        return F.linear(silu_and_mul(F.linear(normed, w["gate_up"])), w["down"])

    def forward(self, h: torch.Tensor, residual: torch.Tensor, rows: slice) -> torch.Tensor:
        for i in range(LAYERS):
            h = self.chain_out(i, self.attention(self.chain_in(i, h, residual, rows), rows), residual)
        return h


def variants(m: Layers):
    half = m.batch // 2
    A, B, ALL = slice(0, half), slice(half, m.batch), slice(0, m.batch)

    def inputs():
        residual = m.x.clone()
        return torch.zeros_like(m.x), residual

    def whole():
        h, residual = inputs()
        return m.forward(h, residual, ALL) + residual

    def halves():
        h, residual = inputs()
        out_a = m.forward(h[A], residual[A], A)
        out_b = m.forward(h[B], residual[B], B)
        return torch.cat([out_a, out_b]) + residual

    def free():
        h, residual = inputs()
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(main)
        # A's first chain goes first; B starts when it is done, so B's chain meets A's attention
        q_a = m.chain_in(0, h[A], residual[A], A)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out_b = m.forward(h[B], residual[B], B)
        h_a = m.chain_out(0, m.attention(q_a, A), residual[A])
        for i in range(1, LAYERS):
            h_a = m.chain_out(i, m.attention(m.chain_in(i, h_a, residual[A], A), A), residual[A])
        main.wait_stream(side)
        return torch.cat([h_a, out_b]) + residual

    def pipe(priority: int):
        def run():
            h, residual = inputs()
            chain, attn = torch.cuda.current_stream(), torch.cuda.Stream()   # the main stream runs the chains
            if priority:
                chain = torch.cuda.Stream(priority=priority)
                chain.wait_stream(torch.cuda.current_stream())
            attn.wait_stream(torch.cuda.current_stream())
            halves_ = {"A": [h[A], residual[A], A, None], "B": [h[B], residual[B], B, None]}
            done = {}     # per half: an event after its latest attention

            def chain_in(name, i):
                hh, res, rows, _ = halves_[name]
                with torch.cuda.stream(chain):
                    halves_[name][3] = m.chain_in(i, hh, res, rows)
                attn.wait_stream(chain)

            def attend(name):
                _, _, rows, q = halves_[name]
                with torch.cuda.stream(attn):
                    halves_[name][3] = m.attention(q, rows)
                    done[name] = torch.cuda.Event()
                    done[name].record(attn)

            def chain_out(name, i):
                _, res, rows, o = halves_[name]
                chain.wait_event(done[name])       # this half's attention, not the other's queued behind it
                with torch.cuda.stream(chain):
                    halves_[name][0] = m.chain_out(i, o, res)

            for name in ("A", "B"):
                chain_in(name, 0)
                attend(name)
            for i in range(LAYERS):
                # attn B(i) runs while A finishes layer i and starts i + 1; then the other way round
                for name in ("A", "B"):
                    chain_out(name, i)
                    if i + 1 < LAYERS:
                        chain_in(name, i + 1)
                        attend(name)
            torch.cuda.current_stream().wait_stream(chain)
            return torch.cat([halves_["A"][0], halves_["B"][0]]) + residual
        return run

    return {"whole": whole, "halves": halves, "free": free, "pipe": pipe(0), "pipe-hi": pipe(-1)}


def replay_us(graph) -> float:
    return replay_ms(graph, reps=15) * 1e3 / LAYERS


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    print(f"stream priorities {lo}..{hi}; us per layer (graph replay / {LAYERS})")
    print("| cache | batch | whole | halves | free | pipe | pipe-hi | best vs whole | rel. error vs whole: halves, free, pipe, pipe-hi |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fp8 in (False, True):
        for batch in BATCHES:
            m = Layers(batch, fp8)
            times, outs = {}, {}
            for name, fn in variants(m).items():
                graph, out = graph_of(fn)
                times[name] = replay_us(graph)
                graph.replay()
                torch.cuda.synchronize()
                outs[name] = out.float().clone()
                del graph
            ref = outs["whole"]
            errors = ", ".join(f"{float((outs[k] - ref).norm() / ref.norm()):.1e}" for k in ("halves", "free", "pipe", "pipe-hi"))
            best = min(times.values())
            row = " | ".join(f"{times[k]:.1f}" for k in ("whole", "halves", "free", "pipe", "pipe-hi"))
            print(f"| {'fp8' if fp8 else 'bf16'} | {batch} | {row} | {100 * (best / times['whole'] - 1):+.1f}% | "
                  f"{errors} |", flush=True)
            del m
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
