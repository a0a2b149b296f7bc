"""Attention of new query tokens over keys and values that live in the paged KV cache.

Every sequence's keys are the first `context_len` token slots of its block table; its new queries
are the last `q_len` of those positions and attend causally. Decode is the case q_len == 1.
Cache layout: [num_blocks, block_size, num_kv_heads, head_dim].

The cache holds 16-bit values, or float8 e4m3 with per-layer or per-KV-head scales (see fp8.py).
For float8 a constexpr switches the same kernels to convert each tile in registers: the key scale
folds into the softmax scale and the value scale into the output, so neither costs a multiply per
element. The products then run in float16 (float32 for float32 queries): e4m3 values convert to
it exactly and in one instruction per pair, where bfloat16 would take a detour through float32.
The decode kernel reads float8 values as 16-bit words of two dimensions (see _decode_kernel).

The decode kernel gives one program to each (sequence, KV head, context split): it loads every
K/V tile once for all query heads of its group, and long contexts can be split over several
programs whose partial results the last of them to finish combines (flash-decoding). A CUDA
graph fixes the split count for the longest context it may meet; in one kernel, a shorter context
takes only the splits it fills, and one of at most DECODE_UNSPLIT_TILES tiles skips the combine
(a second kernel cost 1.9 us a layer whether or not it had anything to combine). Given the rotary
inputs, it also does the rotary kernel's work for small batches: each program normalises and
rotates its heads' queries, and the last split stores the new key and value and attends to them
from registers. The prefill kernel gives one program to each (query tile, sequence, head).
"""
import math

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_kv_cache import check_kv_scales, dequantize_fp8, is_fp8_cache
from nanovllm.kernels.rotary_embedding import KVStore, RotaryInputs, apply_rotary_ref, normed_rotated, to_cache
from nanovllm.kernels.triton_compat import (cuda_major_capability, pdl_launch, start_next_kernel, tl, triton,
                                             wait_for_previous_kernel)
from nanovllm.kernels.zeroed_workspace import last_to_arrive, zeroed_workspace


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of both kernels. q: [num_tokens, num_heads, head_dim] packed by sequence.
    A float8 cache is dequantised to q's dtype with k_scale / v_scale first, then the same math."""
    fp8 = is_fp8_cache(k_cache)
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for i, context_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        blocks = block_tables[i, :-(-context_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:context_len]
        v = v_cache[blocks].flatten(0, 1)[:context_len]
        if fp8:
            k, v = dequantize_fp8(k, k_scale, q.dtype), dequantize_fp8(v, v_scale, q.dtype)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        causal = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k, v, attn_mask=causal,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 callers (the tiny test models) want float32 answers, not tf32 ones
    return "ieee" if dtype == torch.float32 else "tf32"


def _kv_launch_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[tuple, dict]:
    """The scale pointers and the constexprs that pick the cache's storage type. A 16-bit cache
    passes q in place of the scales: the kernel never reads them."""
    scale_stride = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    fp8 = is_fp8_cache(k_cache)
    return ((k_scale, v_scale) if fp8 else (q, q)), dict(KV_FP8=fp8, SCALE_STRIDE=scale_stride,
                                                         DOT_FP16=q.dtype != torch.float32)


@triton.jit
def _e4m3_byte_to_f16(pairs, HIGH: tl.constexpr, PTX: tl.constexpr):
    """The low (HIGH=False) or high byte of each 16-bit word, read as e4m3, in float16. With PTX two
    words take one byte permute and one paired conversion, a fifth fewer instructions in the decode
    loop than shifts and single conversions; the interpreter, which runs no PTX, takes the shifts."""
    if PTX:   # prmt gathers bytes 1 and 3 (HIGH) or 0 and 2 of the two words into one 16-bit pair
        if HIGH:
            select: tl.constexpr = "0x3331"
        else:
            select: tl.constexpr = "0x3320"
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $1, 0, " + select + "; mov.b32 {lo, hi}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; }", "=r,r", [pairs], dtype=tl.float16, is_pure=True, pack=2)
    byte = (pairs >> 8).to(tl.int8) if HIGH else pairs.to(tl.int8)
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _new_token_halves(ptr, stride_seq, seq, kv_head, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """The first and second halves [1, HALF] (float32) of one KV head of a sequence's new key or value."""
    offs = seq * stride_seq + kv_head * HEAD_DIM + tl.arange(0, HALF)[None, :]
    return tl.load(ptr + offs).to(tl.float32), tl.load(ptr + offs + HALF).to(tl.float32)


@triton.jit
def _joined_halves(first, second, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [ROWS, BLOCK_D] whose first half is `first` and second half `second` ([ROWS, BLOCK_D // 2])."""
    return tl.reshape(tl.permute(tl.join(first, second), (0, 2, 1)), [ROWS, BLOCK_D])


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
                   out_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr, scale_log2e, stride_q_seq, stride_q_head,
                   stride_out_seq, stride_out_head, stride_cache_block, stride_cache_token, stride_bt,
                   positions_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, eps, k_new_ptr, v_new_ptr, slot_ptr,
                   stride_k_new, stride_v_new, seq_order_ptr,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, UNSPLIT_TILES: tl.constexpr, PRECISION: tl.constexpr,
                   HEADS_FASTEST: tl.constexpr, KV_FP8: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                   DOT_FP16: tl.constexpr, PTX: tl.constexpr, ROTARY: tl.constexpr, NORM: tl.constexpr,
                   ORDERED: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    if HEADS_FASTEST:   # the KV heads of one token are adjacent in memory: read them together
        kv_head, split, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if ORDERED:   # the programs take the sequences in the order given (see paged_decode_attention)
        seq = tl.load(seq_order_ptr + seq).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq)
    if ROTARY:   # the new token's key and value come from k_new / v_new, not from the cache
        cached_len = tl.maximum(context_len - 1, 0)
    else:
        cached_len = context_len
    num_tiles = tl.cdiv(cached_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    if num_tiles <= UNSPLIT_TILES:   # a short context is not worth the combine
        tiles_per_split = tl.maximum(num_tiles, 1)
    # a CUDA graph fixes NUM_SPLITS for the longest context it may meet: the splits past a
    # shorter one's tiles have nothing to add and end here
    busy_splits = tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)
    if split >= busy_splits:
        return
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    d_mask = d < HEAD_DIM
    if ROTARY:   # q/k norm and rotary as apply_rotary does them (HEAD_DIM is a power of two)
        HALF: tl.constexpr = HEAD_DIM // 2
        pos = tl.load(positions_ptr + seq)
        half = tl.arange(0, HALF)
        cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + half)[None, :]
        sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + half)[None, :]
        q_offs = seq * stride_q_seq + heads[:, None] * stride_q_head + half[None, :]
        q1 = tl.load(q_ptr + q_offs, mask=head_mask[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(q_ptr + q_offs + HALF, mask=head_mask[:, None], other=0.0).to(tl.float32)
        # the new token's key and value too, here rather than after the loop: their loads wait
        # beside q's, and the last split stores them while the loop runs (it reads older slots only)
        k1, k2 = _new_token_halves(k_new_ptr, stride_k_new, seq, kv_head, HEAD_DIM, HALF)
        v1, v2 = _new_token_halves(v_new_ptr, stride_v_new, seq, kv_head, HEAD_DIM, HALF)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        q1, q2 = normed_rotated(q1, q2, q_norm_ptr, eps, cos, sin, q_ptr.dtype.element_ty, HALF, NORM)
        q = _joined_halves(q1, q2, BLOCK_G, BLOCK_D)
        k1, k2 = normed_rotated(k1, k2, k_norm_ptr, eps, cos, sin, q_ptr.dtype.element_ty, HALF, NORM)
        # the cache's values, attended to as the cache holds them (float8: quantised, the scales
        # applied as for the others)
        h = kv_head + tl.zeros([1], tl.int32)
        cache_dtype = k_cache_ptr.dtype.element_ty
        num_kv_heads: tl.constexpr = NUM_HEADS // GROUP
        k1 = to_cache(k1, k_scale_ptr, h, cache_dtype, num_kv_heads, SCALE_STRIDE, KV_FP8)
        k2 = to_cache(k2, k_scale_ptr, h, cache_dtype, num_kv_heads, SCALE_STRIDE, KV_FP8)
        v1 = to_cache(v1, v_scale_ptr, h, cache_dtype, num_kv_heads, SCALE_STRIDE, KV_FP8)
        v2 = to_cache(v2, v_scale_ptr, h, cache_dtype, num_kv_heads, SCALE_STRIDE, KV_FP8)
        owns_new_token = (split == busy_splits - 1) & (context_len > 0)
        if owns_new_token & (slot >= 0):
            offs = ((slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_token
                    + kv_head * HEAD_DIM + half[None, :])
            tl.store(k_cache_ptr + offs, k1)
            tl.store(k_cache_ptr + offs + HALF, k2)
            v_cache_bytes = v_cache_ptr.to(tl.pointer_type(cache_dtype))   # float8 values come as words
            tl.store(v_cache_bytes + offs, v1)
            tl.store(v_cache_bytes + offs + HALF, v2)
    else:
        q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                    mask=head_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = scale_log2e
    if KV_FP8:   # keys are stored divided by k_scale: multiply the scores back
        if DOT_FP16:
            q = q.to(tl.float16)
        qk_scale = scale_log2e * tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)
        v_scale = tl.load(v_scale_ptr + kv_head * SCALE_STRIDE)   # here: behind the loop's reductions it waited

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    # A tile's offsets from its first slot do not change from tile to tile; only that slot does.
    tile_offs = n[:, None] * stride_cache_token + d[None, :]
    if KV_FP8:
        # p @ v wants values transposed (tokens adjacent). ldmatrix transposes 16-bit words; single
        # bytes went through shared memory one load at a time, 40% of the loop's instructions. So
        # float8 values are read as words of two adjacent dimensions, converted after the
        # transpose, and the even and odd dimensions accumulate apart.
        j = tl.arange(0, BLOCK_D // 2)
        pair_offs = n[:, None] * (stride_cache_token // 2) + j[None, :]
        pair_mask = (j < HEAD_DIM // 2)[None, :]
        acc_even = tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(first_tile, last_tile):
        token = tile * BLOCK_N               # a tile never straddles a block: BLOCK_SIZE % BLOCK_N == 0
        block = tl.load(block_tables_ptr + seq * stride_bt + token // BLOCK_SIZE).to(tl.int64)
        first_slot = block * stride_cache_block + (token % BLOCK_SIZE) * stride_cache_token + kv_head * HEAD_DIM
        valid = token + n < cached_len
        k = tl.load(k_cache_ptr + first_slot + tile_offs, mask=valid[:, None] & d_mask[None, :], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if KV_FP8:
            pairs = tl.load(v_cache_ptr + first_slot // 2 + pair_offs, mask=valid[:, None] & pair_mask, other=0)
            v_even = _e4m3_byte_to_f16(pairs, False, PTX).to(q.dtype)
            v_odd = _e4m3_byte_to_f16(pairs, True, PTX).to(q.dtype)
            p = p.to(q.dtype)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=PRECISION)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=PRECISION)
        else:
            v = tl.load(v_cache_ptr + first_slot + tile_offs, mask=valid[:, None] & d_mask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if KV_FP8:   # dimension 2i is acc_even[:, i], 2i + 1 is acc_odd[:, i]
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_G, BLOCK_D])
    if ROTARY:
        if owns_new_token:   # attends to the new key and value from registers
            k_new = _joined_halves(k1.to(tl.float32), k2.to(tl.float32), 1, BLOCK_D)
            v_new = _joined_halves(v1.to(tl.float32), v2.to(tl.float32), 1, BLOCK_D)
            s_new = tl.sum(q.to(tl.float32) * k_new, 1) * qk_scale
            m_new = tl.maximum(m, s_new)
            alpha = tl.exp2(m - m_new)
            p_new = tl.exp2(s_new - m_new)
            l = l * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new
            m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if KV_FP8:   # values are stored divided by v_scale; every split's part is, so the combine stays linear
        out = out * v_scale
    out_mask = head_mask[:, None] & d_mask[None, :]
    out_offs = seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :]
    if NUM_SPLITS == 1:   # compiled without the combine below
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif busy_splits == 1:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # flash-decoding's combine, done by the split that finishes last (no second kernel): each
        # split leaves its normalised output and log2-sum-exp, then counts itself in
        first_row = (seq * NUM_HEADS + heads) * NUM_SPLITS
        tl.store(part_out_ptr + (first_row + split)[:, None] * HEAD_DIM + d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + first_row + split, m + tl.log2(l), mask=head_mask)
        arrivals = arrivals_ptr + seq * (NUM_HEADS // GROUP) + kv_head
        if last_to_arrive(arrivals, busy_splits):
            lse_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
            for other in range(busy_splits):   # .cg: read from L2, where the other SMs' stores landed
                lse_max = tl.maximum(lse_max, tl.load(part_lse_ptr + first_row + other, mask=head_mask,
                                                      other=float("-inf"), cache_modifier=".cg"))
            total = tl.zeros([BLOCK_G], tl.float32)
            summed = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            for other in range(busy_splits):
                lse = tl.load(part_lse_ptr + first_row + other, mask=head_mask, other=float("-inf"), cache_modifier=".cg")
                weight = tl.where(lse > float("-inf"), tl.exp2(lse - lse_max), 0.0)   # a padded head weighs 0
                part = tl.load(part_out_ptr + (first_row + other)[:, None] * HEAD_DIM + d[None, :], mask=out_mask,
                               other=0.0, cache_modifier=".cg")
                total += weight
                summed += weight[:, None] * part
            combined = summed / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + out_offs, combined.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(arrivals, 0)   # zero again for the next call


# Programs per SM that decode_num_splits aims for. A 16-bit cache aimed at 4 until 2026-11-26, when
# one (fewer splits at 4 to 64 sequences) made the 8B shape's steps 1.4-1.7% faster at batch 4, 16
# and 64 on one H100. A float8 cache aims at four, to the nearest split count: at bench.py's long
# contexts (500-2,048 tokens) on one H200 (2026-12-04) that was within 1% of the best split count
# from 8 to 160 sequences, where eight (rounded up) took 2-33% longer from 8 to 128 sequences
# (docs/benchmarks.md). A short context uses only the splits its tiles fill, whatever the count.
FP8_DECODE_PROGRAMS_PER_SM = 4
DECODE_PROGRAMS_PER_SM = 1


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int,
                      cache_dtype: torch.dtype = torch.bfloat16) -> int:
    """Context splits per sequence so that a decode step launches about one program per SM for a
    16-bit cache (rounded up) and four for a float8 one (rounded to the nearest), 1 to 16."""
    programs = num_seqs * num_kv_heads
    if cache_dtype.itemsize == 1:
        splits = round(FP8_DECODE_PROGRAMS_PER_SM * num_sms / programs)
    else:
        splits = -(-DECODE_PROGRAMS_PER_SM * num_sms // programs)
    return max(1, min(16, splits))


# Contexts of at most this many tiles are not split. On an H100 (8B shape, 16-bit and float8 caches,
# batch 1 to 16) one program over two tiles beat two splits and their combine by 1-3 us a layer,
# and four splits of one tile beat two of two or one of four (docs/benchmarks.md).
DECODE_UNSPLIT_TILES = 2

# (tokens per tile, warps, pipeline stages) of the decode kernel: the best of the H100 sweeps for a
# 16-bit cache and, at batch 64 and 256, for a float8 one too (docs/benchmarks.md).
DECODE_TILE = (128, 4, 2)
# Left alone, the float8 decode kernel took 193 registers per thread, which fits two programs on a
# Hopper SM; at 168 three fit without spilling, and on an H100 the kernel ran 7% faster
# (docs/benchmarks.md). With the longest contexts first, 128 beat 168 by 0.9% on bench.py (FP8
# weights, H200). A 16-bit cache keeps the compiler's choice: capping it made that kernel slower.
# Other GPUs keep it too: the cap was measured on Hopper only.
FP8_DECODE_MAX_REGISTERS = 128


def _decode_registers(q: torch.Tensor, kv_fp8: bool) -> dict:
    return dict(maxnreg=FP8_DECODE_MAX_REGISTERS) if kv_fp8 and cuda_major_capability(q) == 9 else {}


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                           num_splits: int = 1, tile_tokens: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, heads_fastest: bool = True,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           unsplit_tiles: int | None = None, rotary: RotaryInputs | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           seq_order: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim], one new token per sequence (already in the cache).
    Given rotary and new_kv = (keys, values, slot_mapping) of the new tokens instead, q and the keys
    are as the projection left them: the kernel normalises and rotates them as apply_rotary does,
    stores the new key and value at their slots and attends to them from registers (one kernel for
    the rotary kernel's work and attention; paged_decode_attention_ref is the twin).
    num_splits: the most programs a sequence's context is split over; a context of at most
    unsplit_tiles tiles (by default DECODE_UNSPLIT_TILES) takes one.
    A float8 cache needs k_scale and v_scale (float32, 1 or num_kv_heads values; see fp8.py).
    seq_order: a permutation of the sequences, the order in which programs take them (the GPU
    starts programs in launch order). Longest context first keeps the last wave short: one program
    per sequence and KV head at 240 sequences of 200-2,048 tokens ran 146 against 157 us in batch
    order, and bench.py's FP8 run gained 0.6-0.9% (H200; docs/benchmarks.md).
    tile_tokens, num_warps, num_stages (by default DECODE_TILE) and the program
    order are tuning knobs (swept on an H100 on 2026-11-23)."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if seq_order is not None and seq_order.shape != (num_seqs,):
        raise ValueError(f"seq_order must hold one index per sequence ({num_seqs}), got shape {tuple(seq_order.shape)}")
    scales, kv_constexprs = _kv_launch_args(q, k_cache, v_cache, k_scale, v_scale)
    if rotary is not None:
        k_new, v_new, slot_mapping = new_kv
        positions, cos_sin_cache, norm_weights, eps = rotary
        assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
        assert q.stride(2) == k_new.stride(2) == v_new.stride(2) == 1 and q.stride(1) == head_dim
        assert k_new.stride(1) == v_new.stride(1) == head_dim and k_cache.is_contiguous() and v_cache.is_contiguous()
        q_norm, k_norm = norm_weights if norm_weights is not None else (q, q)   # unused
    else:
        positions = cos_sin_cache = q_norm = k_norm = k_new = v_new = slot_mapping = q   # unused
        eps = 0.0
    tile_tokens, num_warps, num_stages = (given if given is not None else default for given, default in
                                          zip((tile_tokens, num_warps, num_stages), DECODE_TILE))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        arrivals = zeroed_workspace(q.device, torch.int32, num_seqs * num_kv_heads)   # the kernel leaves it zero
    else:
        part_out = part_lse = arrivals = out   # unused
    block_d = triton.next_power_of_2(head_dim)
    grid = (num_kv_heads, num_splits, num_seqs) if heads_fastest else (num_seqs, num_kv_heads, num_splits)
    if kv_constexprs["KV_FP8"]:   # the kernel reads float8 values two at a time (see _decode_kernel)
        v_cache = v_cache.view(torch.int16)
    _decode_kernel[grid](
        q, k_cache, v_cache, *scales, block_tables, context_lens, out, part_out, part_lse, arrivals,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        positions, cos_sin_cache, q_norm, k_norm, eps, k_new, v_new, slot_mapping, k_new.stride(0), v_new.stride(0),
        q if seq_order is None else seq_order,   # q: unused
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=min(tile_tokens, block_size),
        NUM_SPLITS=num_splits, UNSPLIT_TILES=DECODE_UNSPLIT_TILES if unsplit_tiles is None else unsplit_tiles,
        PRECISION=_dot_precision(q.dtype), HEADS_FASTEST=heads_fastest, **kv_constexprs,
        PTX=cuda_major_capability(q) >= 9, ROTARY=rotary is not None,
        NORM=rotary is not None and rotary.norm_weights is not None, ORDERED=seq_order is not None,
        num_warps=num_warps, num_stages=num_stages,
        **_decode_registers(q, kv_constexprs["KV_FP8"]), **pdl_launch(q))
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                               rotary: RotaryInputs | None = None,
                               new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Torch twin of paged_decode_attention: given rotary, rotate and store first, then attend."""
    if rotary is not None:
        k, v, slot_mapping = new_kv
        q, _ = apply_rotary_ref(rotary.positions, q, k, rotary.cos_sin_cache, rotary.norm_weights, rotary.eps,
                                KVStore(v, k_cache, v_cache, slot_mapping, k_scale, v_scale))
    cu_seqlens_q = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, k_scale, v_scale)


@triton.jit
def _attend_keys(q, m, l, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end, q_pos,
                 qk_scale, stride_cache_block, stride_cache_token, stride_bt, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, CAUSAL: tl.constexpr, KV_FP8: tl.constexpr):
    """Online softmax of a query tile over keys [start, end), BLOCK_N at a time. Only tiles that
    cross the diagonal need CAUSAL: every key before it is visible to every query of the tile."""
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    for token in range(start, end, BLOCK_N):
        block = tl.load(block_tables_ptr + seq * stride_bt + token // BLOCK_SIZE).to(tl.int64)
        k_pos = token + n
        offs = (block * stride_cache_block + (token % BLOCK_SIZE + n)[:, None] * stride_cache_token
                + kv_head * HEAD_DIM + d[None, :])
        kv_mask = (k_pos < end)[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAUSAL:
            s = tl.where((k_pos[None, :] <= q_pos[:, None]) & (k_pos < end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, l, acc


# The block table's row stride changes with every prefill's longest sequence: not specialising on it
# (Triton compiles a variant for 1, for multiples of 16 and for the rest) keeps a prefill that brings
# a new width from compiling mid-serving, which stalls every running request. Decodes replay CUDA
# graphs captured with one width.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                    context_lens_ptr, cu_seqlens_q_ptr,
                    out_ptr, scale_log2e, stride_q_token, stride_q_head, stride_out_token, stride_out_head,
                    stride_cache_block, stride_cache_token, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, KV_FP8: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                    DOT_FP16: tl.constexpr):
    tile_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + seq)
        kv_head = head // GROUP
        m_idx = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_mask = (m_idx < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        q_offs = (q_start + m_idx)[:, None] * stride_q_token + head * stride_q_head + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
        qk_scale = scale_log2e
        if KV_FP8:   # keys are stored divided by k_scale: multiply the scores back
            if DOT_FP16:
                q = q.to(tl.float16)
            qk_scale = scale_log2e * tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)
        q_pos = context_len - q_len + m_idx   # padded rows (past q_len) see every key: finite, never stored

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first_row_pos = context_len - q_len + tile_m * BLOCK_M
        visible_end = first_row_pos // BLOCK_N * BLOCK_N   # keys every row of the tile sees
        key_end = tl.minimum(context_len, first_row_pos + BLOCK_M)
        m, l, acc = _attend_keys(q, m, l, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, 0,
                                 visible_end, q_pos, qk_scale, stride_cache_block, stride_cache_token,
                                 stride_bt, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, PRECISION, False, KV_FP8)
        m, l, acc = _attend_keys(q, m, l, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head,
                                 visible_end, key_end, q_pos, qk_scale, stride_cache_block,
                                 stride_cache_token, stride_bt, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                 PRECISION, True, KV_FP8)
        out = acc / l[:, None]
        if KV_FP8:
            out = out * tl.load(v_scale_ptr + kv_head * SCALE_STRIDE)
        out_offs = (q_start + m_idx)[:, None] * stride_out_token + head * stride_out_head + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_tile(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(query rows, keys per step, warps, pipeline stages) of the prefill kernel. For 16-bit values
    a sweep found 64 x 64 with 4 warps within 5% of the best tile on an H100
    (128-row tiles and 8 warps were slower); float32 (the tiny test models) keeps smaller tiles."""
    if dtype == torch.float32:
        return (64 if head_dim <= 64 else 32), 32, 4, 3
    return 64, 64, 4, 3


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, max_seqlen_q: int, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float,
                            tile: tuple[int, int, int, int] | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] packed by sequence; their K/V are already in the cache.
    tile: (query rows, keys per step, warps, stages), by default prefill_tile().
    A float8 cache needs k_scale and v_scale (float32, 1 or num_kv_heads values; see fp8.py)."""
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    scales, kv_constexprs = _kv_launch_args(q, k_cache, v_cache, k_scale, v_scale)
    block_m, block_n, num_warps, num_stages = tile or prefill_tile(q.dtype, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(max_seqlen_q, block_m), context_lens.shape[0], num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, *scales, block_tables, context_lens, cu_seqlens_q, out, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=min(block_n, block_size), PRECISION=_dot_precision(q.dtype), **kv_constexprs,
        num_warps=num_warps, num_stages=num_stages)
    return out
