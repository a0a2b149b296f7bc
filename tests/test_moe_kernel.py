"""The fused MoE kernel against its torch twin, the twin against naive float64 math, and the
expert alignment step against hand-counted cases.

Without CUDA the kernel runs in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), so the
shapes stay tiny and the dtypes are float32 and float16. Fresh outputs hold NaN, so a row the kernel
never writes fails.
"""
import pytest
import torch

from nanovllm.kernels.fused_moe import DECODE_TILE, PREFILL_TILE, MoeTile, choose_tile, fused_moe, fused_moe_ref
from nanovllm.kernels.moe_routing import align_tokens_kernel, align_tokens_to_experts_ref
from nanovllm.kernels.triton_compat import HAS_TRITON

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])   # the interpreter lacks bf16
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}
SMALL_TILE = MoeTile(block_m=16, block_n=16, block_k=16)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


@pytest.fixture(autouse=True)
def poison_fresh_tensors(monkeypatch):
    """torch.empty returns NaN (integers: their maximum), so an unwritten element cannot pass."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(torch.iinfo(t.dtype).max) if t.dtype != torch.bool else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def naive_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Token by token, slot by slot, in float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += float(topk_weights[t, k]) * (w2[e] @ (gate * torch.sigmoid(gate) * up))
    return out


def routing(pattern: str, num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """topk_ids [T, K], distinct experts per token.
    random: any experts. skewed (top-1 or 2, 5+ experts): expert 1 gets token 0 alone, expert 0 every
    token (top-2) or every other one (top-1), experts 2 and 3 the second slots, experts 4.. nothing."""
    rng = torch.Generator().manual_seed(seed)
    if pattern == "random":
        return torch.stack([torch.randperm(num_experts, generator=rng)[:top_k] for _ in range(num_tokens)])
    assert pattern == "skewed" and top_k in (1, 2) and num_experts >= 5
    first = [1] if top_k == 1 else [0, 1]
    rest = [[0, 2 + r][:top_k] for r in torch.randint(0, 2, (num_tokens - 1,), generator=rng).tolist()]
    return torch.tensor([first] + rest)


def moe_inputs(num_tokens: int, hidden: int, intermediate: int, num_experts: int, topk_ids: torch.Tensor,
               dtype: torch.dtype):
    x = torch.randn(num_tokens, hidden).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate) / intermediate ** 0.5).to(DEVICE, dtype)
    topk_weights = torch.rand(num_tokens, topk_ids.shape[1]).to(DEVICE)
    return x, w13, w2, topk_weights, topk_ids.to(DEVICE)


# ---------------------------------------------------------------- alignment

ALIGNS = pytest.mark.parametrize("align", [align_tokens_to_experts_ref, align_tokens_kernel], ids=["twin", "kernel"])


@ALIGNS
def test_align_hand_counted(align):
    topk_ids = torch.tensor([[1, 3], [3, 2], [3, 1], [1, 0]])      # assignments 0..7 = token * 2 + k
    sorted_ids, expert_ids, end = (t.cpu() for t in align(topk_ids.to(DEVICE), block_m=2, num_experts=5))
    # expert 0: [7] + pad; expert 1: [0, 5, 6] + pad; expert 2: [3] + pad; expert 3: [1, 2, 4] + pad; expert 4: none
    pad = 8
    expected = [7, pad, 0, 5, 6, pad, 3, pad, 1, 2, 4, pad]
    assert sorted_ids[:len(expected)].tolist() == expected
    assert (sorted_ids[len(expected):] == pad).all()
    assert int(end) == 12
    assert expert_ids[:6].tolist() == [0, 1, 1, 2, 3, 3]
    assert (expert_ids[6:] == -1).all()
    assert len(sorted_ids) == len(expert_ids) * 2 >= 8 + 4 * 1      # room for every group's padding


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(1, 1, 4, 16), (1, 8, 128, 16), (37, 2, 8, 16),
                                                                  (300, 8, 16, 64), (5, 8, 8, 4)])
@ALIGNS
def test_align_groups_every_assignment_once_in_single_expert_tiles(num_tokens, top_k, num_experts, block_m, align):
    topk_ids = routing("random", num_tokens, num_experts, top_k, seed=num_tokens)
    sorted_ids, expert_ids, end = (t.cpu() for t in align(topk_ids.to(DEVICE), block_m, num_experts))
    n, end = num_tokens * top_k, int(end)
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    assert end == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted(sorted_ids[sorted_ids < n].tolist()) == list(range(n))          # each assignment once
    assert (sorted_ids[end:] == n).all() and len(sorted_ids) % block_m == 0
    flat = topk_ids.flatten()
    for tile, expert in enumerate(expert_ids.tolist()):
        ids = sorted_ids[tile * block_m:(tile + 1) * block_m]
        if tile * block_m >= end:
            assert expert == -1
            continue
        real = ids[ids < n]
        assert len(real) > 0 and (flat[real] == expert).all()                      # one expert per tile
        assert ids[:len(real)].tolist() == real.tolist()                            # padding only at the end
        assert real.tolist() == sorted(real.tolist())                               # stable: token order


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [(1, 8, 128, 16), (64, 8, 128, 16), (300, 2, 6, 64)])
def test_align_kernel_equals_twin(num_tokens, top_k, num_experts, block_m):
    """Same slots, tiles and end as the twin's stable sort, skewed routing included."""
    for pattern_ids in (routing("random", num_tokens, num_experts, top_k, seed=7),
                        torch.randint(0, 3, (num_tokens, top_k), generator=torch.Generator().manual_seed(8))):
        for got, want in zip(align_tokens_kernel(pattern_ids.to(DEVICE), block_m, num_experts),
                             align_tokens_to_experts_ref(pattern_ids.to(DEVICE), block_m, num_experts)):
            assert torch.equal(got, want)


def test_choose_tile_by_assignments_per_expert():
    assert choose_tile(1, 8, 128) is DECODE_TILE
    assert choose_tile(256, 8, 128) is DECODE_TILE        # 16 per expert on average
    assert choose_tile(257, 8, 128) is PREFILL_TILE
    assert choose_tile(4096, 8, 128) is PREFILL_TILE


# ---------------------------------------------------------------- kernel against twin

CASES = [  # tokens, hidden, intermediate, experts, top_k, routing pattern, tile (None: chosen by size)
    (9, 40, 24, 8, 2, "skewed", SMALL_TILE),     # experts with no token, one token, every token
    (9, 40, 24, 8, 1, "skewed", SMALL_TILE),
    (5, 40, 24, 8, 8, "random", SMALL_TILE),     # top-8 of 8: every expert gets every token
    (3, 33, 20, 12, 8, "random", SMALL_TILE),
    (1, 40, 24, 8, 2, "random", SMALL_TILE),     # one decode token
    (21, 48, 40, 8, 2, "random", None),          # decode tile, wider than the sizes
    (40, 72, 56, 4, 2, "random", None),          # prefill tile: 20 assignments per expert
]


@needs_triton
@dtypes
@pytest.mark.parametrize("num_tokens,hidden,intermediate,num_experts,top_k,pattern,tile", CASES,
                         ids=[f"t{c[0]}-h{c[1]}-i{c[2]}-e{c[3]}-k{c[4]}-{c[5]}-{'small' if c[6] else 'auto'}"
                              for c in CASES])
def test_fused_moe_matches_twin(num_tokens, hidden, intermediate, num_experts, top_k, pattern, tile, dtype):
    torch.manual_seed(num_tokens * 100 + top_k)
    topk_ids = routing(pattern, num_tokens, num_experts, top_k, seed=num_tokens)
    x, w13, w2, topk_weights, topk_ids = moe_inputs(num_tokens, hidden, intermediate, num_experts, topk_ids, dtype)

    out = fused_moe(x, w13, w2, topk_weights, topk_ids, tile=tile)
    ref = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)

    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref.double(), **TOL[dtype])
    torch.testing.assert_close(ref.double(), naive_moe(x, w13, w2, topk_weights, topk_ids), **TOL[dtype])
    assert ref.abs().mean() > 0.05     # the outputs are not all near zero


@needs_triton
def test_fused_moe_ignores_experts_without_tokens():
    """Weights of an expert no token chose are never read: NaN there leaves the output finite."""
    topk_ids = routing("skewed", 6, 8, 2)
    x, w13, w2, topk_weights, topk_ids = moe_inputs(6, 40, 24, 8, topk_ids, torch.float32)
    w13[4:], w2[4:] = float("nan"), float("nan")
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, tile=SMALL_TILE)
    assert out.isfinite().all()
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, topk_weights, topk_ids), **TOL[torch.float32])


def fp8_experts(w: torch.Tensor, group_size: int, dtype: torch.dtype):
    """w [E, N, K] as float8 experts with one scale per row and group_size columns (the last group
    may be short), as Fp8BlockMoEMethod holds a checkpoint's block scales."""
    from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX
    from nanovllm.quantization.fp8 import Fp8Experts
    e, n, k = w.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(w.float(), (0, groups * group_size - k))
    scale = padded.abs().reshape(e, n, groups, group_size).amax(-1) / FP8_MAX
    q = (w.float() / scale.repeat_interleave(group_size, dim=-1)[..., :k]).to(FP8_DTYPE)
    return Fp8Experts(q.contiguous(), scale.contiguous(), group_size, dtype)


FP8_CASES = [  # tokens, hidden, intermediate, top_k, group size, tile
    (9, 40, 24, 2, 16, SMALL_TILE),     # short last groups (40 = 16 + 16 + 8, 24 = 16 + 8)
    (9, 64, 32, 2, 32, SMALL_TILE),     # two tile steps a group
    (21, 64, 48, 2, 16, None),          # the decode tile's 128-column steps cut to the group
    (40, 72, 56, 2, 64, None),          # the prefill tile
    (9, 40, 24, 2, 24, SMALL_TILE),     # groups of 24 (a rank's slice inside one block): read dequantized
]


@needs_triton
@dtypes
@pytest.mark.parametrize("num_tokens,hidden,intermediate,top_k,group_size,tile", FP8_CASES,
                         ids=[f"t{c[0]}-h{c[1]}-i{c[2]}-g{c[4]}-{'small' if c[5] else 'auto'}" for c in FP8_CASES])
def test_fused_moe_reads_float8_experts(num_tokens, hidden, intermediate, top_k, group_size, tile, dtype):
    """Float8 experts with group scales, dequantized in the kernel, against the twin on the same
    experts dequantized one at a time (and that against the 16-bit experts they were made from)."""
    torch.manual_seed(num_tokens + group_size)
    topk_ids = routing("random", num_tokens, 8, top_k, seed=num_tokens)
    x, w13, w2, topk_weights, topk_ids = moe_inputs(num_tokens, hidden, intermediate, 8, topk_ids, dtype)
    q13, q2 = fp8_experts(w13, group_size, dtype), fp8_experts(w2, group_size, dtype)

    out = fused_moe(x, q13, q2, topk_weights, topk_ids, tile=tile)
    ref = fused_moe_ref(x, q13, q2, topk_weights, topk_ids)

    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref.double(), **TOL[dtype])
    unquantized = fused_moe_ref(x, w13, w2, topk_weights, topk_ids).double()
    assert (ref.double() - unquantized).norm() / unquantized.norm() < 0.1      # float8's rounding, no more
