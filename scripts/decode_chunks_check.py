"""Decode attention over equal context chunks against the engine's per-sequence programs.

The engine's decode kernel gives each (sequence, KV head, split) one program; contexts in
bench.py's decode phase run from 100 to 2048 tokens, so programs differ up to 16x in length and
the last ones run on a GPU that is mostly idle. Here every program takes one chunk of at most
CHUNK_TILES tiles of one sequence: programs are equal but for each sequence's last chunk, and a
second kernel combines the chunks' partial results (their log-sum-exp weights). The grid can be
padded with programs that find no chunk and return, as a CUDA graph captured for the largest
chunk count would launch them.

    PYTHONPATH=. python scripts/decode_chunks_check.py
"""
import math

import torch

from nanovllm.kernels.paged_attention import (FP8_DECODE_MAX_REGISTERS, decode_num_splits, paged_attention_ref,
                                              paged_decode_attention)
from nanovllm.kernels.triton_compat import tl, triton
from scripts.fp8_kernel_check import HEAD_DIM, HEADS, KV_HEADS, SCALE, paged_case, relative_error
from scripts.graph_timing import graph_of, replay_ms


@triton.jit
def _chunk_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
                  chunk_seq_ptr, num_chunks_ptr, cu_chunks_ptr, part_out_ptr, part_lse_ptr, scale_log2e,
                  stride_q_seq, stride_q_head, stride_cache_block, stride_cache_token, stride_bt,
                  NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_TILES: tl.constexpr, KV_FP8: tl.constexpr):
    kv_head, chunk = tl.program_id(0), tl.program_id(1)
    if chunk < tl.load(num_chunks_ptr):
        seq = tl.load(chunk_seq_ptr + chunk)
        context_len = tl.load(context_lens_ptr + seq)
        first_tile = (chunk - tl.load(cu_chunks_ptr + seq)) * CHUNK_TILES
        last_tile = tl.minimum(first_tile + CHUNK_TILES, tl.cdiv(context_len, BLOCK_N))
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + g
        head_mask = g < GROUP
        q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                    mask=head_mask[:, None], other=0.0)
        qk_scale = scale_log2e
        if KV_FP8:
            q = q.to(tl.float16)
            qk_scale = scale_log2e * tl.load(k_scale_ptr)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for tile in range(first_tile, last_tile):
            token = tile * BLOCK_N
            block = tl.load(block_tables_ptr + seq * stride_bt + token // BLOCK_SIZE).to(tl.int64)
            valid = token + n < context_len
            offs = (block * stride_cache_block + (token % BLOCK_SIZE + n)[:, None] * stride_cache_token
                    + kv_head * HEAD_DIM + d[None, :])
            k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        if KV_FP8:
            out = out * tl.load(v_scale_ptr)
        row = chunk * NUM_HEADS + heads
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=head_mask[:, None])
        tl.store(part_lse_ptr + row, m + tl.log2(l), mask=head_mask)


@triton.jit
def _combine_chunks_kernel(part_out_ptr, part_lse_ptr, cu_chunks_ptr, out_ptr, stride_out_seq, stride_out_head,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    first = tl.load(cu_chunks_ptr + seq)
    count = tl.load(cu_chunks_ptr + seq + 1) - first
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, HEAD_DIM)
    row = (first + c) * NUM_HEADS + head
    lse = tl.load(part_lse_ptr + row, mask=c < count, other=float("-inf"))
    weight = tl.where(c < count, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(c < count)[:, None], other=0.0)
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d, out.to(out_ptr.dtype.element_ty))


def chunk_plan(lens: torch.Tensor, chunk_tokens: int, padded_chunks: int | None = None):
    """Each sequence's chunks, in order: the sequence of every chunk, the first chunk of every
    sequence (and the total at the end), the number of chunks (on the device, as a graph reads it)."""
    counts = (lens + chunk_tokens - 1) // chunk_tokens
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = counts.cumsum(0)
    total = int(cu[-1])
    chunk_seq = torch.repeat_interleave(torch.arange(len(lens), device=lens.device, dtype=torch.int32), counts)
    grid = max(total, padded_chunks or 0)
    seq_of = torch.zeros(grid, dtype=torch.int32, device=lens.device)
    seq_of[:total] = chunk_seq
    return seq_of, cu, cu[-1:].clone(), grid, int(counts.max())


def chunked_decode(q, k_cache, v_cache, lens, tables, k_scale, v_scale, plan, chunk_tiles, tile, warps, stages):
    seq_of, cu, num_chunks, grid, max_count = plan
    num_seqs = q.shape[0]
    fp8 = k_cache.dtype.itemsize == 1
    part_out = torch.empty(grid * HEADS, HEAD_DIM, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(grid * HEADS, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    registers = dict(maxnreg=FP8_DECODE_MAX_REGISTERS) if fp8 else {}
    _chunk_kernel[(KV_HEADS, grid)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, tables, lens, seq_of, num_chunks, cu,
        part_out, part_lse, SCALE * math.log2(math.e), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), tables.stride(0), NUM_HEADS=HEADS, GROUP=HEADS // KV_HEADS, BLOCK_G=16,
        HEAD_DIM=HEAD_DIM, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=tile, CHUNK_TILES=chunk_tiles, KV_FP8=fp8,
        num_warps=warps, num_stages=stages, **registers)
    _combine_chunks_kernel[(num_seqs, HEADS)](part_out, part_lse, cu, out, out.stride(0), out.stride(1),
                                              NUM_HEADS=HEADS, HEAD_DIM=HEAD_DIM,
                                              BLOCK_C=triton.next_power_of_2(max_count))
    return out


def graph_us(fn, reps: int = 16) -> float:
    """fn captured reps times in one CUDA graph (as the decode graph runs it: no host in between);
    median replay time / reps, in microseconds."""
    graph, _ = graph_of(lambda: [fn() for _ in range(reps)])
    return replay_ms(graph) * 1e3 / reps


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), torch.__version__, "triton", triton.__version__)
    print("in-graph us per call (16 calls per graph); engine splits: the heuristic's choice is starred")
    print("| batch | cache | engine 1 / 2 / 3 / 6 splits | chunks of 2 / 4 tiles (grid padded to the longest) | error |")
    print("| --- | --- | --- | --- | --- |")
    for batch in (16, 32, 48, 64, 96, 128, 192, 256):
        c = paged_case(batch, seed=batch)
        cu_q = torch.arange(batch + 1, device="cuda")
        for fp8 in (True, False):
            k, v = (c["k8"], c["v8"]) if fp8 else (c["k"], c["v"])
            scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"]) if fp8 else {}
            ref = paged_attention_ref(c["q"], k, v, cu_q, c["lens"], c["tables"], SCALE, **scales)
            chosen = decode_num_splits(batch, KV_HEADS, sms, k.dtype)
            engine, chunked, error = [], [], 0.0
            for splits in sorted({1, 2, 3, 6, chosen}):
                fn = lambda: paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, num_splits=splits,
                                                    **scales)
                error = max(error, relative_error(fn(), ref))
                engine.append(f"{graph_us(fn):.1f}{'*' if splits == chosen else ''}")
            for chunk_tiles in (2, 4):
                plan = chunk_plan(c["lens"], chunk_tiles * 128, batch * 16 // chunk_tiles)
                fn = lambda: chunked_decode(c["q"], k, v, c["lens"], c["tables"], c["k_scale"], c["v_scale"], plan,
                                            chunk_tiles, 128, 4, 2)
                error = max(error, relative_error(fn(), ref))
                chunked.append(f"{graph_us(fn):.1f}")
            print(f"| {batch} | {'fp8' if fp8 else 'bf16'} | {' / '.join(engine)} | {' / '.join(chunked)} | "
                  f"{error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
