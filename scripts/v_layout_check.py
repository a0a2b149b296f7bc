"""Decode attention with values stored token-last ([block, kv_head, head_dim, token]) against the
engine's kernel (values token-major, like keys), for a float8 and a bfloat16 cache.

Why: `tl.dot(p, v)` wants v with tokens (its reduction axis) contiguous. Token-major float8 values
are transposed through shared memory one byte at a time (no 8-bit ldmatrix.trans on sm_90); stored
token-last they load like keys do. The earlier token-last try masked every token, which cost the
loads their vector width; here the mask is per 16 tokens (or none), and the slots a partial group
reads past the context are finite (the pool starts zeroed, and stores write finite values) and
weigh exactly 0 in p.

    PYTHONPATH=. python scripts/v_layout_check.py
"""
import math

import torch
from triton.testing import do_bench

from nanovllm.kernels.fp8 import FP8_DTYPE
from nanovllm.kernels.paged_attention import paged_attention_ref, paged_decode_attention
from nanovllm.kernels.triton_compat import tl, triton
from scripts.fp8_kernel_check import HEAD_DIM, HEADS, KV_HEADS, SCALE, paged_case, relative_error


@triton.jit
def _decode_vt_kernel(q_ptr, k_cache_ptr, vt_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                      context_lens_ptr, out_ptr, scale_log2e, stride_q_seq, stride_q_head, stride_out_seq,
                      stride_out_head, stride_cache_block, stride_cache_token, stride_vt_block, stride_vt_head,
                      stride_bt, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
                      V_MASK: tl.constexpr):
    kv_head, seq = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
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
    for tile in range(0, num_tiles):
        token = tile * BLOCK_N
        block = tl.load(block_tables_ptr + seq * stride_bt + token // BLOCK_SIZE).to(tl.int64)
        valid = token + n < context_len
        k_offs = (block * stride_cache_block + (token % BLOCK_SIZE + n)[:, None] * stride_cache_token
                  + kv_head * HEAD_DIM + d[None, :])
        k = tl.load(k_cache_ptr + k_offs, mask=valid[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        vt_offs = (block * stride_vt_block + kv_head * stride_vt_head + d[:, None] * BLOCK_SIZE
                   + (token % BLOCK_SIZE + n)[None, :])
        if V_MASK == 0:
            vt = tl.load(vt_cache_ptr + vt_offs)
        elif V_MASK == 16:
            group_valid = (token + n) // 16 * 16 < context_len
            vt = tl.load(vt_cache_ptr + vt_offs, mask=group_valid[None, :], other=0.0)
        else:
            vt = tl.load(vt_cache_ptr + vt_offs, mask=valid[None, :], other=0.0)
        if KV_FP8:
            vt = vt.to(q.dtype)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), tl.trans(vt))
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])


def launch_token_last(kernel, q, k_cache, vt_cache, lens, tables, k_scale, v_scale, tile, **options):
    """Launch a decode kernel over keys stored token-major and values token-last, with the
    signature of _decode_vt_kernel (one program per KV head and sequence); options are the
    kernel's other constexprs and the launch options."""
    out = torch.empty_like(q)
    kernel[(KV_HEADS, q.shape[0])](
        q, k_cache, vt_cache, k_scale, v_scale, tables, lens, out, SCALE * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        vt_cache.stride(0), vt_cache.stride(1), tables.stride(0), GROUP=HEADS // KV_HEADS, BLOCK_G=16,
        HEAD_DIM=HEAD_DIM, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=tile, **options)
    return out


def decode_vt(q, k_cache, vt_cache, lens, tables, k_scale, v_scale, tile, warps, stages, v_mask):
    fp8 = k_cache.dtype == FP8_DTYPE
    return launch_token_last(_decode_vt_kernel, q, k_cache, vt_cache, lens, tables, k_scale if fp8 else q,
                             v_scale if fp8 else q, tile, KV_FP8=fp8, V_MASK=v_mask, num_warps=warps,
                             num_stages=stages)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| batch | cache | kernel | tile, warps, stages | time | K/V read | error vs twin |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for batch in (64, 256):
        c = paged_case(batch, seed=batch)
        cu = torch.arange(batch + 1, device="cuda")
        for fp8 in (True, False):
            k, v = (c["k8"], c["v8"]) if fp8 else (c["k"], c["v"])
            scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"]) if fp8 else {}
            vt = v.permute(0, 2, 3, 1).contiguous()
            ref = paged_attention_ref(c["q"], k, v, cu, c["lens"], c["tables"], SCALE, **scales)
            nbytes = c["tokens"] * KV_HEADS * HEAD_DIM * 2 * k.element_size()
            label = "fp8" if fp8 else "bf16"

            def row(name, knobs, fn):
                out = fn()
                ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                print(f"| {batch} | {label} | {name} | {knobs} | {ms * 1e3:.1f} us | {nbytes / ms / 1e6:,.0f} GB/s "
                      f"| {relative_error(out, ref):.1e} |", flush=True)

            row("engine (token-major V)", (128, 4, 2),
                lambda: paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, **scales))
            row("engine, 1 split", (128, 4, 2),
                lambda: paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, num_splits=1, **scales))
            for v_mask in (0, 16, 1):
                for tile, warps, stages in ((128, 4, 2), (128, 4, 3), (64, 4, 3), (256, 8, 2), (128, 8, 2)):
                    try:
                        row(f"token-last V, mask {v_mask}", (tile, warps, stages),
                            lambda: decode_vt(c["q"], k, vt, c["lens"], c["tables"], c["k_scale"], c["v_scale"],
                                              tile, warps, stages, v_mask))
                    except Exception as e:   # e.g. out of shared memory
                        print(f"| {batch} | {label} | mask {v_mask} | {(tile, warps, stages)} | {type(e).__name__} | | |")
            row("engine again", (128, 4, 2),
                lambda: paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, **scales))


if __name__ == "__main__":
    main()
