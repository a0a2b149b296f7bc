"""Every Triton kernel against its torch twin, and each twin against naive float64 math.

With CUDA the kernels run natively over the full matrix (bfloat16 too); without it conftest.py sets
TRITON_INTERPRET=1 and a small matrix runs in Triton's interpreter, float32 and float16 only.
Fresh outputs and unused cache slots hold NaN, so a kernel that skips a write or reads past a
sequence's context fails.
"""
import math

import pytest
import torch

from nanovllm.attention.triton import causal_varlen_attention
from nanovllm.kernels.paged_attention import (decode_num_splits, paged_attention_ref, paged_decode_attention,
                                              paged_prefill_attention)
from nanovllm.kernels.rms_norm import rms_norm, rms_norm_ref
from nanovllm.kernels.rotary_embedding import KVStore, apply_rotary, apply_rotary_ref
from nanovllm.kernels.sampling import CHUNK, gumbel_argmax, gumbel_argmax_ref
from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from nanovllm.kernels.triton_compat import HAS_TRITON
from nanovllm.layers.rotary import RotaryEmbedding

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])   # the interpreter lacks bf16
TOL = {
    torch.float32: dict(atol=2e-3, rtol=2e-3) if CUDA else dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
}
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 16   # a small GPU's count

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


@pytest.fixture(autouse=True)
def poison_fresh_tensors(monkeypatch):
    """Kernels allocate their outputs with torch.empty: fill those with NaN (integers with their
    maximum) so an element the kernel never writes cannot pass as a right answer."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.requires_grad:
            return t
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(torch.iinfo(t.dtype).max) if t.dtype != torch.bool else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


@pytest.fixture(autouse=True)
def fixed_seed():
    torch.manual_seed(0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype])


def packed_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Random q, k, v as the model makes them: head-strided views of one packed qkv tensor."""
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    return qkv, q, k, v


def make_paged_cache(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, spare_blocks: int = 3):
    """NaN-filled K/V caches holding each sequence's first context_len tokens in shuffled physical
    blocks. Block 0 (what the model runner pads block tables with) and the spare blocks stay unused.
    Returns k_cache, v_cache, block_tables and each sequence's dense (k, v)."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    # two spare columns, like the CUDA-graph buffers whose rows are wider than any table
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 2, dtype=torch.int64, device=DEVICE)
    dense = []
    for i, (context_len, num_seq_blocks) in enumerate(zip(context_lens, blocks_per_seq)):
        blocks, free = torch.tensor(free[:num_seq_blocks], dtype=torch.int64, device=DEVICE), free[num_seq_blocks:]
        block_tables[i, :num_seq_blocks] = blocks
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=DEVICE)).flatten()[:context_len]
        k, v = torch.randn(2, context_len, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        dense.append((k, v))
    return k_cache, v_cache, block_tables, dense


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T) v in float64, the queries being the last len(q) of the len(k) positions (causal).
    q: [q_len, heads, head_dim]; k, v: [context_len, kv_heads, head_dim]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(len(k) - len(q), len(k), device=q.device)
    scores.masked_fill_(torch.arange(len(k), device=q.device)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# ---------------------------------------------------------------- KV store (done by the rotary kernel)

STORE_CASES = [  # block_size, num_kv_heads, head_dim
    (16, 3, 64), (16, 1, 128), (256, 2, 128), (256, 8, 64),
]


def store_inputs(num_tokens: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, cache_dtype: torch.dtype, num_padding: int):
    """Inputs of the fused rotary + K/V store: q, k, v as strided views of one packed tensor, slots
    of which num_padding are -1 (padding), positions, the rotary cache, q/k norm weights, and four
    NaN-poisoned caches (ours and the twin's, K and V), so any stray write shows."""
    _, q, key, value = packed_qkv(num_tokens, 2 * num_kv_heads, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[torch.randperm(num_tokens, device=DEVICE)[:num_padding]] = -1
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    cos_sin = RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to(DEVICE)
    weights = (torch.randn(head_dim, device=DEVICE).to(dtype), torch.randn(head_dim, device=DEVICE).to(dtype))
    poisoned = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), device=DEVICE).to(cache_dtype)
    return q, key, value, slots, positions, cos_sin, weights, [poisoned.clone() for _ in range(4)]


@needs_triton
@dtypes
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", STORE_CASES,
                         ids=[f"block{b}-kv{h}-d{d}" for b, h, d in STORE_CASES])
def test_rotary_stores_keys_and_values_at_valid_slots_and_skips_padding(block_size, num_kv_heads, head_dim, dtype):
    q, key, value, slots, positions, cos_sin, weights, caches = store_inputs(
        40, 6, block_size, num_kv_heads, head_dim, dtype, dtype, num_padding=10)
    key_before = key.clone()
    k_cache, v_cache, k_ref, v_ref = caches

    _, rotated = apply_rotary(positions, q, key, cos_sin, weights, EPS, KVStore(value, k_cache, v_cache, slots))
    _, rotated_ref = apply_rotary_ref(positions, q.clone(), key_before, cos_sin, weights, EPS,
                                      KVStore(value, k_ref, v_ref, slots))

    valid = slots >= 0
    for cache, new in ((k_cache, rotated), (v_cache, value)):
        rows = cache.view(-1, num_kv_heads, head_dim)
        assert torch.equal(rows[slots[valid]], new[valid])                      # the kernel's own rows, exactly
        assert int((~rows.isnan()).all(-1).all(-1).sum()) == int(valid.sum())   # nothing else written
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)
    assert_close(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0), dtype)
    assert torch.equal(k_ref.view(-1, num_kv_heads, head_dim)[slots[valid]], rotated_ref[valid])


# ---------------------------------------------------------------- paged decode attention

def _decode_case(block_size, head_dim, num_kv_heads, group, context_lens, tile_tokens=128):
    return pytest.param(block_size, head_dim, num_kv_heads, group, context_lens, tile_tokens,
                        id=f"block{block_size}-d{head_dim}-kv{num_kv_heads}-gqa{group}-seqs{len(context_lens)}"
                           f"-max{max(context_lens)}" + (f"-tile{tile_tokens}" if tile_tokens != 128 else ""))


def _lengths(num_seqs: int, block_size: int, longest: int, seed: int) -> list[int]:
    """1, a block end, one past it, the longest, and random lengths between."""
    rng = torch.Generator().manual_seed(seed)
    edges = [1, longest, block_size, block_size + 1]
    return (edges + torch.randint(1, longest + 1, (num_seqs,), generator=rng).tolist())[:num_seqs]


DECODE_SMALL = [
    _decode_case(16, 64, 2, 1, [1]),
    _decode_case(16, 128, 4, 1, [33, 5, 160]),
    _decode_case(16, 128, 2, 2, [16, 17, 300]),
    _decode_case(16, 64, 1, 8, [15, 32, 1, 100, 48, 7, 250, 64]),
    _decode_case(256, 64, 1, 2, [256, 300]),
    _decode_case(256, 128, 2, 8, [1, 129], tile_tokens=32),
]
DECODE_FULL = [
    _decode_case(block_size, head_dim, num_kv_heads, group, _lengths(num_seqs, block_size, longest, seed))
    for seed, (block_size, head_dim, group, num_kv_heads, num_seqs, longest) in enumerate([
        (16, 64, 1, 4, 1, 1), (16, 128, 2, 2, 3, 700), (16, 128, 8, 4, 64, 4096), (16, 64, 8, 1, 130, 2000),
        (256, 128, 1, 8, 8, 3000), (256, 64, 2, 4, 64, 5000), (256, 128, 8, 2, 3, 4096), (256, 128, 4, 8, 96, 1500),
    ])
] + [_decode_case(256, 128, 4, 2, [1, 255, 256, 257, 3000], tile_tokens=64)]


@needs_triton
@dtypes
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # an empty split's log2(0) = -inf
@pytest.mark.parametrize("splits", [1, 4, "auto"], ids=lambda s: f"splits_{s}")
@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,group,context_lens,tile_tokens",
                         DECODE_FULL if CUDA else DECODE_SMALL)
def test_paged_decode_attention(block_size, head_dim, num_kv_heads, group, context_lens, tile_tokens, splits, dtype):
    k_cache, v_cache, block_tables, dense = make_paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype)
    num_seqs, scale = len(context_lens), head_dim ** -0.5
    _, q, _, _ = packed_qkv(num_seqs, num_kv_heads * group, num_kv_heads, head_dim, dtype)
    q.mul_(2)   # sharper softmax, so the running maximum is rescaled more; q stays a strided view
    lens = torch.tensor(context_lens, device=DEVICE)
    num_splits = decode_num_splits(num_seqs, num_kv_heads, NUM_SMS) if splits == "auto" else splits

    out = paged_decode_attention(q, k_cache, v_cache, lens, block_tables, scale, num_splits=num_splits,
                                 tile_tokens=tile_tokens)
    ref = paged_attention_ref(q, k_cache, v_cache, torch.arange(num_seqs + 1, device=DEVICE), lens, block_tables, scale)

    assert_close(out, ref, dtype)
    for i, (k, v) in enumerate(dense):
        assert_close(ref[i:i + 1], dense_attention(q[i:i + 1], k, v, scale), dtype)


@needs_triton
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # an empty split's log2(0) = -inf
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_attention_program_orders_agree(splits):
    """Which programs run first changes only the schedule: each one computes the same numbers."""
    context_lens = [40, 1, 300, 17, 256]
    k_cache, v_cache, block_tables, _ = make_paged_cache(context_lens, 16, 2, 64, torch.float32)
    _, q, _, _ = packed_qkv(len(context_lens), 4, 2, 64, torch.float32)
    lens = torch.tensor(context_lens, device=DEVICE)
    by_head, by_seq = (paged_decode_attention(q, k_cache, v_cache, lens, block_tables, 0.125, num_splits=splits,
                                              heads_fastest=order) for order in (True, False))
    longest_first = paged_decode_attention(q, k_cache, v_cache, lens, block_tables, 0.125, num_splits=splits,
                                           seq_order=torch.tensor([2, 4, 0, 3, 1], device=DEVICE))
    assert not by_head.isnan().any()
    assert torch.equal(by_head, by_seq)
    assert torch.equal(by_head, longest_first)
    with pytest.raises(ValueError, match="seq_order"):
        paged_decode_attention(q, k_cache, v_cache, lens, block_tables, 0.125, seq_order=torch.tensor([2, 4]))
    assert_close(by_head, paged_attention_ref(q, k_cache, v_cache, torch.arange(len(context_lens) + 1, device=DEVICE),
                                              lens, block_tables, 0.125), torch.float32)


def test_decode_num_splits_targets_one_program_per_sm_within_1_to_16():
    assert decode_num_splits(1, 8, 132) == 16          # ceil(132 / 8) = 17, capped
    assert decode_num_splits(4, 8, 132) == 5           # ceil(132 / 32)
    assert decode_num_splits(16, 8, 132) == 2          # ceil(132 / 128)
    assert decode_num_splits(64, 8, 132) == 1          # enough programs without splitting
    assert decode_num_splits(3, 1, 4) == 2             # ceil(4 / 3)
    assert decode_num_splits(1, 1, 4) == 4
    assert decode_num_splits(512, 8, 132) == 1
    for num_sms in (1, 16, 78, 132):
        for num_kv_heads in (1, 2, 8):
            splits = [decode_num_splits(n, num_kv_heads, num_sms) for n in (1, 2, 3, 8, 32, 64, 256, 1024)]
            assert all(1 <= s <= 16 for s in splits)
            assert splits == sorted(splits, reverse=True)   # more sequences never ask for more splits
            # splitting further would not bring the launch below ~4 programs per SM
            assert all(s == 1 or (s - 1) * n * num_kv_heads < 4 * num_sms
                       for s, n in zip(splits, (1, 2, 3, 8, 32, 64, 256, 1024)))


# ---------------------------------------------------------------- paged prefill attention

def _prefill_case(block_size, head_dim, num_kv_heads, group, chunks):
    return pytest.param(block_size, head_dim, num_kv_heads, group, chunks,
                        id=f"block{block_size}-d{head_dim}-kv{num_kv_heads}-gqa{group}-"
                           + "_".join(f"{cached}+{q_len}" for cached, q_len in chunks))


PREFILL_SMALL = [  # chunks: (cached tokens, new query tokens) per sequence
    _prefill_case(16, 64, 2, 2, [(0, 5), (8, 20), (48, 70), (15, 1)]),
    _prefill_case(16, 128, 1, 8, [(40, 9), (0, 33), (17, 16)]),
    _prefill_case(256, 64, 2, 1, [(200, 60), (0, 3)]),
]
PREFILL_FULL = [
    _prefill_case(16, 128, 4, 2, [(0, 5), (8, 200), (48, 70), (15, 1), (3000, 512), (1024, 64)]),
    _prefill_case(16, 64, 1, 8, [(40, 9), (0, 300), (17, 16), (2000, 129)]),
    _prefill_case(256, 128, 2, 1, [(200, 60), (0, 3), (256, 256), (1000, 33)]),
    _prefill_case(256, 64, 8, 4, [(4000, 100), (255, 1), (512, 257)]),
]


@needs_triton
@dtypes
@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,group,chunks", PREFILL_FULL if CUDA else PREFILL_SMALL)
def test_paged_prefill_attention_over_cached_prefix(block_size, head_dim, num_kv_heads, group, chunks, dtype):
    context_lens = [cached + q_len for cached, q_len in chunks]
    k_cache, v_cache, block_tables, dense = make_paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype)
    q_lens = [q_len for _, q_len in chunks]
    cu_seqlens_q = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).int()
    scale = head_dim ** -0.5
    _, q, _, _ = packed_qkv(sum(q_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype)
    q.mul_(2)
    lens = torch.tensor(context_lens, device=DEVICE)

    out = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, max(q_lens), lens, block_tables, scale)
    ref = paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, lens, block_tables, scale)

    assert_close(out, ref, dtype)
    for (k, v), start, end in zip(dense, cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        assert_close(ref[start:end], dense_attention(q[start:end], k, v, scale), dtype)


@needs_triton
@pytest.mark.parametrize("tile", [(16, 16, 4, 2), (16, 64, 4, 3), (64, 16, 4, 3), (32, 32, 8, 4)], ids=str)
def test_paged_prefill_attention_any_tile(tile):
    """The split between keys every query of a tile sees and the diagonal holds whichever of the
    query tile and the key step is larger."""
    chunks = [(0, 5), (8, 40), (48, 70), (15, 1), (100, 17)]
    context_lens = [cached + q_len for cached, q_len in chunks]
    k_cache, v_cache, block_tables, _ = make_paged_cache(context_lens, 64, 2, 64, torch.float32)
    q_lens = [q_len for _, q_len in chunks]
    cu_seqlens_q = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).int()
    _, q, _, _ = packed_qkv(sum(q_lens), 4, 2, 64, torch.float32)
    lens = torch.tensor(context_lens, device=DEVICE)

    out = paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, max(q_lens), lens, block_tables, 0.125, tile)

    assert_close(out, paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, lens, block_tables, 0.125), torch.float32)


@dtypes
def test_causal_varlen_attention_shares_each_kv_head_with_its_query_group(dtype):
    """Plain prefills of packed sequences: q, k, v as the model leaves them (head-strided views of
    one qkv tensor, four query heads a KV head), 16-bit CUDA tensors through the flash kernel, which
    reads each K/V head once for its group; the rest through PyTorch's attention a sequence at a time."""
    q_lens = [1, 37, 130, 64, 5] if CUDA else [1, 9, 20]
    cu_seqlens = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).int()
    _, q, k, v = packed_qkv(sum(q_lens), 8, 2, 64, dtype)

    out = causal_varlen_attention(q, k, v, cu_seqlens, max(q_lens), 0.125)

    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        assert_close(out[start:end], dense_attention(q[start:end], k[start:end], v[start:end], 0.125), dtype)


# ---------------------------------------------------------------- RMSNorm

RMS_SMALL = [(37, 1000), (130, 64), (3, 4096)]   # rows: tokens, N: hidden size
RMS_FULL = [(1, 4096), (257, 5120), (1000, 2048), (33, 1000), (4099, 64)]
EPS = 1e-6


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()


@needs_triton
@dtypes
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows,hidden", RMS_FULL if CUDA else RMS_SMALL, ids=lambda v: str(v))
def test_rms_norm(rows, hidden, residual, dtype):
    x = (torch.randn(rows, hidden, device=DEVICE) * 3 + 0.5).to(dtype)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    x_before = x.clone()
    if not residual:
        out = rms_norm(x, weight, EPS)
        assert_close(out, rms_norm_ref(x, weight, EPS), dtype)
        assert_close(out, naive_rms_norm(x, weight), dtype)
    else:
        res = torch.randn(rows, hidden, device=DEVICE).to(dtype)
        res_before = res.clone()
        out, new_res = rms_norm(x, weight, EPS, res)
        ref_out, ref_res = rms_norm_ref(x, weight, EPS, res_before)
        assert new_res is res                                            # updated in place
        torch.testing.assert_close(new_res, x_before + res_before, atol=0, rtol=0)   # same rounding as torch
        assert_close(out, ref_out, dtype)
        torch.testing.assert_close(ref_res, x_before + res_before, atol=0, rtol=0)
        assert_close(out, naive_rms_norm(x_before + res_before, weight), dtype)
    assert torch.equal(x, x_before)


HEAD_NORM_SMALL = [(37, 4, 2, 128), (5, 16, 8, 64)]   # tokens, q heads, kv heads, head_dim
HEAD_NORM_FULL = [(1000, 32, 8, 128), (3, 16, 8, 64), (513, 6, 2, 128)]


@needs_triton
@dtypes
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", HEAD_NORM_FULL if CUDA else HEAD_NORM_SMALL,
                         ids=lambda v: str(v))
def test_rms_norm_per_head_on_strided_views(tokens, heads, kv_heads, head_dim, dtype):
    qkv, q, k, _ = packed_qkv(tokens, heads, kv_heads, head_dim, dtype)
    qkv_before = qkv.clone()
    for x in (q, k):   # the q/k norms of Qwen3: one row per (token, head) of a view into qkv
        weight = torch.randn(head_dim, device=DEVICE).to(dtype)
        out = rms_norm(x, weight, EPS)
        assert out.shape == x.shape
        assert_close(out, rms_norm_ref(x, weight, EPS), dtype)
        assert_close(out, naive_rms_norm(x, weight), dtype)
    assert torch.equal(qkv, qkv_before)   # the views are read, never written


# ---------------------------------------------------------------- rotary embedding

ROTARY_SMALL = [(37, 4, 2, 128), (9, 6, 3, 64)]   # tokens, q heads, kv heads, head_dim
ROTARY_FULL = [(1000, 32, 8, 128), (257, 16, 4, 64), (3, 40, 8, 128)]
MAX_POSITION = 40960


def naive_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + half]) pair as a complex number, in float64."""
    cos, sin = cos_sin.double().chunk(2, dim=-1)
    x1, x2 = x.double().chunk(2, dim=-1)
    rotated = torch.complex(x1, x2) * torch.complex(cos, sin).unsqueeze(1)
    return torch.cat((rotated.real, rotated.imag), dim=-1)


@needs_triton
@dtypes
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", ROTARY_FULL if CUDA else ROTARY_SMALL,
                         ids=lambda v: str(v))
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "head_norm"])
def test_rotary_in_place_on_packed_qkv(tokens, heads, kv_heads, head_dim, norm, dtype):
    cache = RotaryEmbedding(head_dim, MAX_POSITION, 1e6).cos_sin_cache.to(DEVICE)
    positions = torch.randint(0, MAX_POSITION, (tokens,), device=DEVICE)
    positions[:2] = torch.tensor([0, MAX_POSITION - 1], device=DEVICE)
    qkv, q, k, v = packed_qkv(tokens, heads, kv_heads, head_dim, dtype)
    qkv.mul_(3).add_(0.5)   # rows far from unit RMS, so a missing norm shows
    qkv_before = qkv.clone()
    weights = (torch.randn(head_dim, device=DEVICE).to(dtype), torch.randn(head_dim, device=DEVICE).to(dtype))
    norm_args = (weights, EPS) if norm else ()
    q_ref, k_ref = apply_rotary_ref(positions, q.clone(), k.clone(), cache, *norm_args)

    q_out, k_out = apply_rotary(positions, q, k, cache, *norm_args)

    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(v, qkv_before[:, heads + kv_heads:])   # the v part of qkv is untouched
    q_in, k_in = qkv_before[:, :heads], qkv_before[:, heads:heads + kv_heads]
    if norm:
        q_in, k_in = naive_rms_norm(q_in, weights[0]), naive_rms_norm(k_in, weights[1])
        # one fused pass equals the norm kernel followed by the rotary kernel
        q_two, k_two = apply_rotary(positions, rms_norm(qkv_before[:, :heads], weights[0], EPS),
                                    rms_norm(qkv_before[:, heads:heads + kv_heads], weights[1], EPS), cache)
        assert_close(q, q_two, dtype)
        assert_close(k, k_two, dtype)
    assert_close(q_ref, naive_rotary(q_in, cache[positions]), dtype)
    assert_close(k_ref, naive_rotary(k_in, cache[positions]), dtype)


# ---------------------------------------------------------------- SiLU and multiply

SILU_SMALL = [(7, 1000), (3, 2500), (1, 64)]   # tokens, intermediate size
SILU_FULL = [(1, 11008), (512, 3072), (33, 9728), (4096, 1000)]


@needs_triton
@dtypes
@pytest.mark.parametrize("tokens,intermediate", SILU_FULL if CUDA else SILU_SMALL, ids=lambda v: str(v))
def test_silu_and_mul(tokens, intermediate, dtype):
    x = (torch.randn(tokens, 2 * intermediate, device=DEVICE) * 3).to(dtype)
    out = silu_and_mul(x)
    assert_close(out, silu_and_mul_ref(x), dtype)
    gate, up = x.double().chunk(2, dim=-1)
    assert_close(out, gate * torch.sigmoid(gate) * up, dtype)


# ---------------------------------------------------------------- Gumbel-max sampling

VOCAB_SMALL = [100, CHUNK, CHUNK + 904]
VOCAB_FULL = VOCAB_SMALL + [151936]


@needs_triton
@dtypes
@pytest.mark.parametrize("vocab", VOCAB_FULL if CUDA else VOCAB_SMALL, ids=lambda v: f"vocab{v}")
def test_gumbel_argmax_temperature_zero_is_argmax(vocab, dtype):
    scores = torch.randn(6, vocab, device=DEVICE).to(dtype)
    scores[0, -1] = 20                        # the maximum in the last (partial) chunk
    scores[1, 0] = 20
    scores[2, vocab // 2 + 1] = 20
    scores[3] = 0                             # all tied: the first index, like torch.argmax
    scores[4, [3, vocab - 2]] = 20            # tied across chunks: the first one
    temperatures = torch.tensor([0, 0, 0, 0, 0, 1.0], device=DEVICE)   # a sampled row beside them
    seeds = torch.arange(6, device=DEVICE)

    tokens = gumbel_argmax(scores, temperatures, seeds)

    assert tokens[:5].tolist() == [vocab - 1, 0, vocab // 2 + 1, 0, 3]
    assert torch.equal(tokens[:5], scores[:5].argmax(-1))
    assert torch.equal(tokens[:5], gumbel_argmax_ref(scores, temperatures, seeds.tolist())[:5])
    assert 0 <= int(tokens[5]) < vocab


@needs_triton
def test_gumbel_argmax_seeds_reproduce_and_vary():
    vocab = CHUNK + 904
    scores = torch.randn(8, vocab, device=DEVICE) * 0.5
    scores[1] = scores[0]
    scores[7, -1] = 60                        # far above the noise: drawn whatever the seed
    temperatures = torch.ones(8, device=DEVICE)
    seeds = torch.tensor([7, 7, 8, 9, 10, 11, 12, 13], device=DEVICE)

    tokens = gumbel_argmax(scores, temperatures, seeds)

    assert torch.equal(gumbel_argmax(scores, temperatures, seeds), tokens)
    assert torch.equal(gumbel_argmax(scores.flip(0), temperatures, seeds.flip(0)), tokens.flip(0))   # row-independent
    assert tokens[0] == tokens[1]                             # same seed, same scores
    assert len(set(tokens[1:7].tolist())) >= 4               # different seeds, different draws
    assert tokens[7] == vocab - 1


@needs_triton
def test_gumbel_argmax_samples_softmax_of_scaled_scores():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, float("-inf")], device=DEVICE)
    temperature, rows = 0.8, 200
    expected = torch.softmax(logits / temperature, dim=0).double()
    scores = logits.expand(rows, -1).contiguous()
    temperatures = torch.full((rows,), temperature, device=DEVICE)
    seeds = torch.arange(1000, 1000 + rows, device=DEVICE)
    bound = 4 * (expected * (1 - expected) / rows).sqrt() + 0.01   # ~4 standard deviations

    for tokens in (gumbel_argmax(scores, temperatures, seeds), gumbel_argmax_ref(scores, temperatures, seeds.tolist())):
        frequencies = torch.bincount(tokens, minlength=8).double() / rows
        assert frequencies[7] == 0                            # a -inf score is never drawn
        assert ((frequencies - expected).abs() <= bound).all(), (frequencies, expected)


@needs_triton
def test_gumbel_argmax_draws_each_chunk_with_its_share():
    """Chunk 0 holds CHUNK equal scores, chunk 1 one token as likely as all of them together, chunk 2
    one token twice as likely; the rest is -inf. Draws must land in the chunks a quarter, a quarter
    and half of the time, and spread over chunk 0. Scores and temperature are halved together, so
    the probabilities stay those and the temperature must be applied in both stages."""
    rows, vocab, temperature = 300, 3 * CHUNK + 100, 0.5
    logits = torch.full((vocab,), float("-inf"))
    logits[:CHUNK] = 0.0
    logits[CHUNK + 17] = math.log(CHUNK)
    logits[2 * CHUNK + 5] = math.log(2 * CHUNK)
    scores = (logits * temperature).expand(rows, -1).contiguous().to(DEVICE)
    tokens = gumbel_argmax(scores, torch.full((rows,), temperature, device=DEVICE),
                           torch.arange(rows, device=DEVICE) * 7919).cpu()

    expected = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    frequencies = torch.bincount(tokens // CHUNK, minlength=4).double() / rows
    bound = 4 * (expected * (1 - expected) / rows).sqrt() + 0.01   # ~4 standard deviations
    assert frequencies[3] == 0 and ((frequencies[:3] - expected).abs() <= bound).all(), frequencies
    assert set(tokens[tokens // CHUNK == 1].tolist()) == {CHUNK + 17}
    assert set(tokens[tokens // CHUNK == 2].tolist()) == {2 * CHUNK + 5}
    in_first = tokens[tokens < CHUNK]
    assert len(set(in_first.tolist())) >= 0.9 * len(in_first)       # spread: ~1 repeat expected in ~75 draws


@needs_triton
def test_gumbel_argmax_noise_is_independent_across_chunks():
    """Equal scores everywhere: the draw must land in every chunk, not only in the first
    (noise repeated chunk by chunk would tie, and ties go to the first chunk)."""
    rows, vocab = 30, 3 * CHUNK
    scores = torch.zeros(rows, vocab, device=DEVICE)
    tokens = gumbel_argmax(scores, torch.ones(rows, device=DEVICE), torch.arange(rows, device=DEVICE))
    assert (torch.bincount(tokens // CHUNK, minlength=3) >= 3).all(), tokens


@needs_triton
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # an empty split's log2(0) = -inf
@pytest.mark.parametrize("unsplit_tiles", [0, 3])
def test_paged_decode_split_combine_repeats_and_leaves_its_counts_zero(unsplit_tiles):
    """The split that finishes last combines the others and zeroes its arrival count: calls in a
    row (as CUDA-graph replays are) give the same bits, an empty sequence gives zeros, and the
    counts are zero after each call; a context of at most unsplit_tiles tiles in one program changes none of it."""
    from nanovllm.kernels.zeroed_workspace import zeroed_workspace
    context_lens = [0, 300, 1, 129]   # none, every split busy, one token, fewer tiles than splits
    k_cache, v_cache, block_tables, _ = make_paged_cache(context_lens, 16, 2, 64, torch.float32)
    _, q, _, _ = packed_qkv(len(context_lens), 4, 2, 64, torch.float32)
    lens = torch.tensor(context_lens, device=DEVICE)
    first, again = (paged_decode_attention(q, k_cache, v_cache, lens, block_tables, 0.125, num_splits=4, tile_tokens=16,
                                           unsplit_tiles=unsplit_tiles) for _ in range(2))
    assert torch.equal(first, again) and not zeroed_workspace(q.device, torch.int32, 0).any()
    assert not first[0].any()
    assert_close(first[1:], paged_attention_ref(q, k_cache, v_cache, torch.arange(len(context_lens) + 1, device=DEVICE),
                                                lens, block_tables, 0.125)[1:], torch.float32)
