"""Decode attention with both products transposed, so that tokens (then dimensions), not the few
query heads of a group, fill the rows of the tensor-core tiles; float8 cache, values stored
token-last ([block, kv_head, head_dim, token]). Against the engine's kernel.

Why: Nsight Compute on the engine's float8 decode kernel (scripts/ncu_decode.py) shows it bound by
issue, not by memory: 93.7 M warp instructions against 54.1 M for bfloat16 at twice the bytes,
2.85 warps per scheduler of which 0.73 are eligible, 2.48 TB/s. With the query group (2 heads) as
the rows of `tl.dot(q, k^T)` the tiles are 16 rows of which 2 are used, the kernel runs
`mma.sync`, and float8 values reach it through a byte-wise transpose in shared memory. Written
as S^T = K Q^T and O^T = V^T P^T, the rows are 128 tokens and 128 dimensions: on Hopper Triton may
use warp-group MMA, with the converted keys and values as the register operand, and token-last
values need no transpose.

    PYTHONPATH=. python scripts/transposed_decode_check.py
"""
import torch
from triton.testing import do_bench

from nanovllm.kernels.paged_attention import paged_attention_ref, paged_decode_attention
from nanovllm.kernels.triton_compat import tl, triton
from scripts.fp8_kernel_check import HEAD_DIM, KV_HEADS, SCALE, paged_case, relative_error
from scripts.v_layout_check import launch_token_last


@triton.jit
def _decode_t_kernel(q_ptr, k_cache_ptr, vt_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                     context_lens_ptr, out_ptr, scale_log2e, stride_q_seq, stride_q_head, stride_out_seq,
                     stride_out_head, stride_cache_block, stride_cache_token, stride_vt_block, stride_vt_head,
                     stride_bt, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, V_MASK: tl.constexpr):
    kv_head, seq = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    q_t = tl.load(q_ptr + seq * stride_q_seq + heads[None, :] * stride_q_head + d[:, None],
                  mask=head_mask[None, :], other=0.0).to(tl.float16)          # [HEAD_DIM, BLOCK_G]
    qk_scale = scale_log2e * tl.load(k_scale_ptr)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc_t = tl.zeros([HEAD_DIM, BLOCK_G], tl.float32)
    for tile in range(0, num_tiles):
        token = tile * BLOCK_N
        block = tl.load(block_tables_ptr + seq * stride_bt + token // BLOCK_SIZE).to(tl.int64)
        valid = token + n < context_len
        k = tl.load(k_cache_ptr + block * stride_cache_block + (token % BLOCK_SIZE + n)[:, None] * stride_cache_token
                    + kv_head * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
        s_t = tl.dot(k.to(tl.float16), q_t) * qk_scale                    # [BLOCK_N, BLOCK_G]
        s_t = tl.where(valid[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(s_t, 0))
        p_t = tl.exp2(s_t - m_new[None, :])
        alpha = tl.exp2(m - m_new)
        vt_ptrs = (vt_cache_ptr + block * stride_vt_block + kv_head * stride_vt_head + d[:, None] * BLOCK_SIZE
                   + (token % BLOCK_SIZE + n)[None, :])
        if V_MASK:
            vt = tl.load(vt_ptrs, mask=valid[None, :], other=0.0)
        else:   # slots past the context hold finite values, and p is 0 there
            vt = tl.load(vt_ptrs)
        l = l * alpha + tl.sum(p_t, 0)
        acc_t = acc_t * alpha[None, :] + tl.dot(vt.to(tl.float16), p_t.to(tl.float16))   # [HEAD_DIM, BLOCK_G]
        m = m_new
    out_t = acc_t / tl.where(l > 0, l, 1.0)[None, :] * tl.load(v_scale_ptr)
    tl.store(out_ptr + seq * stride_out_seq + heads[None, :] * stride_out_head + d[:, None],
             out_t.to(out_ptr.dtype.element_ty), mask=head_mask[None, :])


def decode_t(q, k_cache, vt_cache, lens, tables, k_scale, v_scale, tile=128, warps=4, stages=2, v_mask=0,
             maxnreg=None):
    extra = {} if maxnreg is None else dict(maxnreg=maxnreg)
    return launch_token_last(_decode_t_kernel, q, k_cache, vt_cache, lens, tables, k_scale, v_scale, tile,
                             V_MASK=v_mask, num_warps=warps, num_stages=stages, **extra)


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print("| batch | kernel | tile, warps, stages, maxnreg | time | K/V read | error vs twin |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in (64, 256):
        c = paged_case(batch, seed=batch)
        cu = torch.arange(batch + 1, device="cuda")
        k, v = c["k8"], c["v8"]
        scales = dict(k_scale=c["k_scale"], v_scale=c["v_scale"])
        vt = v.permute(0, 2, 3, 1).contiguous()
        ref = paged_attention_ref(c["q"], k, v, cu, c["lens"], c["tables"], SCALE, **scales)
        nbytes = c["tokens"] * KV_HEADS * HEAD_DIM * 2

        def row(name, knobs, fn):
            try:
                out = fn()
                ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            except Exception as e:   # out of resources, or a compile error
                print(f"| {batch} | {name} | {knobs} | {type(e).__name__}: {str(e)[:80]} | | |", flush=True)
                return
            print(f"| {batch} | {name} | {knobs} | {ms * 1e3:.1f} us | {nbytes / ms / 1e6:,.0f} GB/s "
                  f"| {relative_error(out, ref):.1e} |", flush=True)

        row("engine, 1 split", (128, 4, 2, 168),
            lambda: paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, num_splits=1, **scales))
        for tile, warps, stages in ((128, 4, 2), (128, 4, 3), (64, 4, 3), (128, 8, 2), (64, 4, 4)):
            for maxnreg in (None, 128):
                for v_mask in (0, 1):
                    row(f"transposed, V mask {v_mask}", (tile, warps, stages, maxnreg),
                        lambda: decode_t(c["q"], k, vt, c["lens"], c["tables"], c["k_scale"], c["v_scale"], tile,
                                         warps, stages, v_mask, maxnreg))
        row("engine, 1 split, again", (128, 4, 2, 168),
            lambda: paged_decode_attention(c["q"], k, v, c["lens"], c["tables"], SCALE, num_splits=1, **scales))


if __name__ == "__main__":
    main()
