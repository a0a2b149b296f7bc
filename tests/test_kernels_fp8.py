"""Float8 (e4m3) KV cache: the store, decode and cached-prefill kernels against their torch twins,
the twins' quantisation against hand-computed values, and the quantisation error itself.

On the CPU the kernels run in Triton's interpreter. Its float -> e4m3 conversion (triton 3.9,
`triton.runtime.interpreter._convert_float`) does not round as the GPU does: a rounding that
carries out of the mantissa loses the carry when the exponent is odd (124.4 -> 64, not 128), ties
go away from zero instead of to even (1.0625 -> 1.125, not 1.0), and results in e4m3's subnormal
range are truncated (0.0054 -> 0.0039, not 0.0059); 11% of a spread of values came out wrong.
Loads and e4m3 -> float conversions are right (all 254 finite codes). So on the CPU a fixture
routes only that one conversion through torch's (round to nearest even, which is what the GPU's
cvt.rn.satfinite.e4m3x2 does for values the kernels have clamped to +-448); on CUDA nothing is
replaced and the same tests check the hardware's rounding.
"""
import os

import numpy as np
import pytest
import torch

from nanovllm.kernels import paged_attention
from nanovllm.kernels.fp8_kv_cache import (FP8_DTYPE, SCALE_FLOOR, check_kv_scales, dequantize_fp8, kv_scale_from_absmax,
                                  quantize_fp8)
from nanovllm.kernels.paged_attention import (decode_num_splits, paged_attention_ref, paged_decode_attention,
                                              paged_decode_attention_ref, paged_prefill_attention)
from nanovllm.kernels.rotary_embedding import KVStore, RotaryInputs, apply_rotary, apply_rotary_ref, store_kvcache_ref
from nanovllm.kernels.triton_compat import HAS_TRITON, tl, triton
from nanovllm.layers.rotary import RotaryEmbedding
from tests.test_kernels import (CUDA, DEVICE, EPS, NUM_SMS, TOL, assert_close, dense_attention, fixed_seed,  # noqa: F401
                                make_paged_cache, needs_triton, packed_qkv, poison_fresh_tensors, store_inputs)

QUERY_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
query_dtypes = pytest.mark.parametrize("dtype", QUERY_DTYPES, ids=lambda d: str(d).removeprefix("torch."))


@pytest.fixture(autouse=True)
def interpreter_rounds_to_e4m3_like_the_gpu(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1" or not HAS_TRITON:
        return
    from triton.runtime import interpreter
    convert = interpreter._convert_float

    def convert_rounding_to_nearest_even(data, src, dst, rounding_mode):
        if dst == tl.float8e4nv and src in (tl.float32, tl.float16):
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32 if src == tl.float32 else np.float16))
            return x.to(FP8_DTYPE).view(torch.uint8).numpy()
        return convert(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert_rounding_to_nearest_even)


def scales(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=DEVICE)


def fp8_paged_cache(context_lens, block_size, num_kv_heads, head_dim, k_scale, v_scale):
    """make_paged_cache's float32 cache (NaN in unused slots), stored as e4m3 with the scales;
    also each sequence's unquantised dense (k, v)."""
    k_cache, v_cache, block_tables, dense = make_paged_cache(context_lens, block_size, num_kv_heads, head_dim,
                                                             torch.float32)
    return quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale), block_tables, dense


def dequantized_dense(k8, v8, block_tables, context_lens, k_scale, v_scale):
    """Each sequence's K/V as the cache holds them, in float64: stored * scale."""
    block_size, out = k8.shape[1], []
    for i, n in enumerate(context_lens):
        blocks = block_tables[i, :-(-n // block_size)]
        k, v = k8[blocks].flatten(0, 1)[:n], v8[blocks].flatten(0, 1)[:n]
        out.append((dequantize_fp8(k, k_scale, torch.float64), dequantize_fp8(v, v_scale, torch.float64)))
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


# ---------------------------------------------------------------- quantisation (twins, by hand)

def test_quantize_rounds_to_nearest_even_clamps_and_scales_per_head():
    # head 0 scale 0.5 (stored = 2x), head 1 scale 2.0 (stored = x / 2)
    x = torch.tensor([[[0.5, 0.53125, 0.59375, 3.9, -300.0, 0.00146484375]],
                      [[2.0, 2.125, 2.375, 15.6, 1000.0, -0.005859375]]]).transpose(0, 1)   # [1, 2 heads, 6]
    stored = quantize_fp8(x, torch.tensor([0.5, 2.0]))
    # 1.0 exact; 1.0625 is the tie between 1.0 and 1.125 -> even 1.0; 1.1875 -> even 1.25;
    # 7.8 -> 8 (the rounding carries into the exponent); -600 clamps to -448;
    # 0.0029296875 = 1.5 subnormal steps of 2^-9 -> even 2 steps = 0.00390625
    assert stored.float()[0, 0].tolist() == [1.0, 1.0, 1.25, 8.0, -448.0, 0.00390625]
    # head 1: 1.0, 1.0625 -> 1.0, 1.1875 -> 1.25, 7.8 -> 8, 500 -> 448, -0.0029296875 -> -0.00390625
    assert stored.float()[0, 1].tolist() == [1.0, 1.0, 1.25, 8.0, 448.0, -0.00390625]
    assert dequantize_fp8(stored, torch.tensor([0.5, 2.0]), torch.float32)[0].tolist() == [
        [0.5, 0.5, 0.625, 4.0, -224.0, 0.001953125], [2.0, 2.0, 2.5, 16.0, 896.0, -0.0078125]]
    one_scale = quantize_fp8(x, torch.tensor([0.5]))   # one scale for every head
    assert one_scale.float()[0, 1].tolist() == [4.0, 4.0, 5.0, 32.0, 448.0, -0.01171875]   # 4.25, 4.75: ties


def test_store_twin_quantises_valid_slots_only():
    k_cache = torch.full((2, 4, 1, 2), float("nan")).to(FP8_DTYPE)
    v_cache = k_cache.clone()
    key = torch.tensor([[[1.0, -2.0]], [[9.0, 9.0]], [[0.3, 1000.0]]])
    value = -key
    store_kvcache_ref(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]), torch.tensor([0.25]), torch.tensor([4.0]))
    assert k_cache.float()[1, 1, 0].tolist() == [4.0, -8.0]          # slot 5 = block 1, offset 1
    assert k_cache.float()[0, 0, 0].tolist() == [1.25, 448.0]        # 0.3 / 0.25 = 1.2 -> 1.25; clamped
    assert v_cache.float()[1, 1, 0].tolist() == [-0.25, 0.5]
    assert v_cache.float()[0, 0, 0].tolist() == [-0.078125, -256.0]   # steps of 2^-7 and 16 there
    assert int((~k_cache.float().isnan()).sum()) == 4                # the padding token wrote nothing


def test_scale_from_absmax_per_layer_and_per_head():
    x = torch.zeros(5, 2, 4)
    x[3, 0, 1], x[1, 1, 2] = -8.96, 2.24
    assert torch.allclose(kv_scale_from_absmax(x), torch.tensor([0.02]))
    assert torch.allclose(kv_scale_from_absmax(x, per_head=True), torch.tensor([0.02, 0.005]))
    assert torch.equal(kv_scale_from_absmax(torch.zeros(3, 2, 4)), torch.tensor([SCALE_FLOOR]))
    stored = quantize_fp8(x, kv_scale_from_absmax(x, per_head=True))
    assert stored.float()[3, 0, 1] == -448 and stored.float()[1, 1, 2] == 448   # the largest maps to e4m3's largest
    with pytest.raises(ValueError, match="inf or NaN"):
        kv_scale_from_absmax(torch.tensor([[[float("inf")]]]))
    with pytest.raises(ValueError, match="x: expected"):
        kv_scale_from_absmax(torch.zeros(0, 2, 4))


def test_quantisation_error_of_elements_and_of_attention():
    """The error e4m3 storage itself costs, with scales from kv_scale_from_absmax: per element at
    most 2^-4 relative above e4m3's subnormals (about 2.6% RMS); attention output against the
    unquantised K/V, on Gaussian K/V (a worst case: the output is a near-cancelling average),
    measured over seeds and 100 to 2000 keys: 3.3-4.1% relative (Frobenius) with unit-variance
    queries, 3.6-7.4% with queries x 2 (the key error grows with the softmax's sharpness); in
    units of the values' RMS 0.1-2%."""
    torch.manual_seed(1)
    k, v = torch.randn(2, 2000, 4, 128, dtype=torch.float64)
    k_scale, v_scale = kv_scale_from_absmax(k), kv_scale_from_absmax(v, per_head=True)
    k_back = dequantize_fp8(quantize_fp8(k, k_scale), k_scale, torch.float64)
    normal = k.abs() >= 2 ** -6 * k_scale
    element_error = ((k_back - k).abs() / k.abs())[normal]
    assert element_error.max() <= 2 ** -4
    assert 0.02 < element_error.pow(2).mean().sqrt() < 0.03
    v_back = dequantize_fp8(quantize_fp8(v, v_scale), v_scale, torch.float64)
    for q_gain, bound in ((1, 0.045), (2, 0.08)):
        for context_len in (100, 700, 2000):
            q = torch.randn(1, 8, 128, dtype=torch.float64) * q_gain
            exact = dense_attention(q, k[:context_len], v[:context_len], 128 ** -0.5)
            stored = dense_attention(q, k_back[:context_len], v_back[:context_len], 128 ** -0.5)
            assert relative_error(stored, exact) < bound, (q_gain, context_len)
            assert (stored - exact).pow(2).mean().sqrt() < 0.025   # the values' RMS is 1


def test_check_kv_scales_names_the_bad_argument():
    k8 = torch.zeros(2, 4, 3, 8, dtype=FP8_DTYPE)
    one, per_head = torch.ones(1), torch.ones(3)
    assert check_kv_scales(k8, k8, one, one) == 0
    assert check_kv_scales(k8, k8, per_head, per_head) == 1
    assert check_kv_scales(k8.half(), k8.half(), None, None) == 0
    for args, message in [((k8, k8, None, one), "k_scale is required"),
                          ((k8, k8, one, None), "v_scale is required"),
                          ((k8, k8, one.double(), one), "k_scale must be float32"),
                          ((k8, k8, one, torch.ones(2)), "v_scale must hold 1 or num_kv_heads=3"),
                          ((k8, k8, torch.ones(3, 2)[:, 0], per_head), "k_scale must hold"),
                          ((k8, k8, one, per_head), "must both be per layer or both per KV head"),
                          ((k8.half(), k8.half(), one, None), "k_scale is given but the cache is torch.float16"),
                          ((k8, k8.half(), one, one), "share a dtype"),
                          ((k8.view(torch.float8_e5m2), k8.view(torch.float8_e5m2), one, one), "8-bit caches must be")]:
        with pytest.raises(ValueError, match=message):
            check_kv_scales(*args)


@needs_triton
def test_paged_kernels_reject_an_fp8_cache_without_scales():
    k8, v8, block_tables, _ = fp8_paged_cache([5], 16, 1, 64, scales([1.0]), scales([1.0]))
    q = torch.randn(1, 2, 64, device=DEVICE)
    lens = torch.tensor([5], device=DEVICE)
    with pytest.raises(ValueError, match="k_scale is required"):
        paged_decode_attention(q, k8, v8, lens, block_tables, 0.125)
    with pytest.raises(ValueError, match="v_scale is required"):
        paged_prefill_attention(q, k8, v8, torch.tensor([0, 1], device=DEVICE).int(), 1, lens, block_tables, 0.125,
                                k_scale=scales([1.0]))


@needs_triton
def test_the_kernels_cast_to_e4m3_rounds_to_nearest_even():
    """The conversion the store kernel ends with, on hand-picked values (ties, a carry into the
    exponent, subnormals): the GPU's own on CUDA, torch's stand-in on the CPU (module docstring)."""
    @triton.jit
    def cast(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, tl.load(x_ptr + i).to(out_ptr.dtype.element_ty))

    x = torch.tensor([1.0625, 1.1875, 7.8, 124.4, -0.0029296875, 0.0054, 448.0, -3.0], device=DEVICE)
    out = torch.empty(8, dtype=FP8_DTYPE, device=DEVICE)
    cast[(1,)](x, out, N=8)
    assert out.float().tolist() == [1.0, 1.25, 8.0, 128.0, -0.00390625, 0.005859375, 448.0, -3.0]


# ---------------------------------------------------------------- KV store (done by the rotary kernel)

STORE_CASES = [  # block_size, num_kv_heads, head_dim, k scales, v scales
    pytest.param(16, 3, 64, [0.013], [0.007], id="block16-kv3-d64-layer_scale"),
    pytest.param(16, 2, 128, [0.004, 0.021], [0.9, 0.011], id="block16-kv2-d128-head_scales"),
] + ([pytest.param(256, 8, 128, [0.0071] * 4 + [0.02] * 4, [0.013 * (h + 1) for h in range(8)],
                   id="block256-kv8-d128-head_scales")] if CUDA else [])


@needs_triton
@query_dtypes
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,k_scale,v_scale", STORE_CASES)
def test_rotary_stores_quantised_keys_and_values(block_size, num_kv_heads, head_dim, k_scale, v_scale, dtype):
    k_scale, v_scale = scales(k_scale), scales(v_scale)
    q, key, value, slots, positions, cos_sin, weights, caches = store_inputs(
        24, 4, block_size, num_kv_heads, head_dim, dtype, FP8_DTYPE, num_padding=6)
    value.mul_(3)   # some values beyond 448 * v_scale, which must clamp
    key_before = key.clone()
    k_cache, v_cache, k_ref, v_ref = caches

    _, rotated = apply_rotary(positions, q, key, cos_sin, weights, EPS,
                              KVStore(value, k_cache, v_cache, slots, k_scale, v_scale))
    _, rotated_ref = apply_rotary_ref(positions, q.clone(), key_before, cos_sin, weights, EPS,
                                      KVStore(value, k_ref, v_ref, slots, k_scale, v_scale))

    valid = slots >= 0
    bits = lambda t: t.view(torch.uint8)   # noqa: E731  (NaN == NaN, -0 != +0)
    for cache, new, scale in ((k_cache, rotated, k_scale), (v_cache, value, v_scale)):
        rows = cache.view(-1, num_kv_heads, head_dim)
        assert torch.equal(bits(rows[slots[valid]]), bits(quantize_fp8(new[valid], scale)))   # its own rows, exactly
        assert int((~rows.float().isnan()).all(-1).all(-1).sum()) == int(valid.sum())        # nothing else written
    assert torch.equal(bits(v_cache), bits(v_ref))
    assert (v_cache.float().abs().nan_to_num() == 448).any()   # the clamp was exercised
    # the rotated keys differ by the rotation's rounding (the twin rounds every op to dtype), and
    # their stored forms by that plus at most one e4m3 step
    assert_close(rotated, rotated_ref, dtype)
    rotation_gap = float((rotated.double() - rotated_ref.double()).abs().max())
    k_out, k_expected = (dequantize_fp8(c, k_scale, torch.float64).nan_to_num(7.0) for c in (k_cache, k_ref))
    step = 2.0 ** -3 * torch.maximum(k_out.abs(), k_expected.abs()) + 2.0 ** -9 * k_scale.reshape(-1, 1).double()
    assert ((k_out - k_expected).abs() <= step + rotation_gap).all()
    assert relative_error(k_out, k_expected) < 0.01


# ---------------------------------------------------------------- paged decode attention

def _decode_case(block_size, head_dim, num_kv_heads, group, context_lens, k_scale, v_scale, tile_tokens=None):
    return pytest.param(block_size, head_dim, num_kv_heads, group, context_lens, k_scale, v_scale, tile_tokens,
                        id=f"block{block_size}-d{head_dim}-kv{num_kv_heads}-gqa{group}-max{max(context_lens)}"
                           f"-{'head' if len(k_scale) > 1 else 'layer'}_scales" + (f"-tile{tile_tokens}" if tile_tokens else ""))


DECODE_SMALL = [
    _decode_case(16, 64, 2, 4, [33, 5, 160], [0.011, 0.0105], [0.0099, 0.02]),
    _decode_case(32, 64, 1, 8, [1, 45, 100], [0.013], [0.35], tile_tokens=16),
    _decode_case(16, 128, 4, 1, [17, 70], [0.02, 0.01, 0.05, 0.0099], [0.01, 0.03, 0.2, 0.0101]),
]
DECODE_FULL = DECODE_SMALL + [
    _decode_case(256, 128, 8, 2, [1, 255, 256, 257, 700, 2048, 100, 1500], [0.01] * 8, [0.02] * 8),
    _decode_case(256, 128, 8, 2, [300, 4000, 513], [0.0123], [0.0456], tile_tokens=128),
    _decode_case(512, 128, 2, 8, [1, 511, 513, 3000], [0.009], [0.011], tile_tokens=256),
    _decode_case(16, 64, 4, 4, list(range(1, 130, 7)), [0.015, 0.01, 0.02, 0.03], [0.01] * 4),
]


@needs_triton
@query_dtypes
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # an empty split's log2(0) = -inf
@pytest.mark.parametrize("splits", [1, 3] + (["auto"] if CUDA else []), ids=lambda s: f"splits_{s}")
@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,group,context_lens,k_scale,v_scale,tile_tokens",
                         DECODE_FULL if CUDA else DECODE_SMALL)
def test_paged_decode_attention_over_fp8_cache(block_size, head_dim, num_kv_heads, group, context_lens,
                                               k_scale, v_scale, tile_tokens, splits, dtype):
    k_scale, v_scale = scales(k_scale), scales(v_scale)
    k8, v8, block_tables, dense = fp8_paged_cache(context_lens, block_size, num_kv_heads, head_dim, k_scale, v_scale)
    num_seqs, scale = len(context_lens), head_dim ** -0.5
    _, q, _, _ = packed_qkv(num_seqs, num_kv_heads * group, num_kv_heads, head_dim, dtype)
    q.mul_(2)   # sharper softmax; q stays a strided view
    lens = torch.tensor(context_lens, device=DEVICE)
    num_splits = decode_num_splits(num_seqs, num_kv_heads, NUM_SMS, FP8_DTYPE) if splits == "auto" else splits

    out = paged_decode_attention(q, k8, v8, lens, block_tables, scale, num_splits=num_splits, tile_tokens=tile_tokens,
                                 k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_ref(q, k8, v8, torch.arange(num_seqs + 1, device=DEVICE), lens, block_tables, scale,
                              k_scale, v_scale)

    assert_close(out, ref, dtype)
    stored = dequantized_dense(k8, v8, block_tables, context_lens, k_scale, v_scale)
    for i, ((k, v), (k_float, v_float)) in enumerate(zip(stored, dense)):
        assert_close(ref[i:i + 1], dense_attention(q[i:i + 1], k, v, scale), dtype)
        # against the unquantised K/V: the storage error (3.6-7.4% at this sharpness, test above)
        assert relative_error(out[i:i + 1], dense_attention(q[i:i + 1], k_float, v_float, scale)) < 0.1


def new_token_slots(block_tables: torch.Tensor, context_lens: list[int], block_size: int) -> torch.Tensor:
    """The cache slot of each sequence's last position (its new token); -1 for a padding row (0)."""
    return torch.tensor([int(block_tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
                         for i, n in enumerate(context_lens)], device=DEVICE)


FUSED_DECODE_CASES = [  # block_size, head_dim, kv_heads, group, context lens (with the new token; 0 pads), splits, q/k norm
    (16, 64, 2, 2, [1, 33, 160, 0, 17], 1, True),
    (16, 128, 1, 4, [300, 2, 129], 3, True),
    (16, 64, 2, 1, [40, 256, 0], 4, False),
]


@needs_triton
@query_dtypes
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # an empty split's log2(0) = -inf
@pytest.mark.parametrize("cache", ["16-bit", "fp8-layer", "fp8-head"])
@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,group,context_lens,splits,norm", FUSED_DECODE_CASES,
                         ids=[f"case{i}" for i in range(len(FUSED_DECODE_CASES))])
def test_decode_attention_with_rotary_equals_rotary_then_attention(block_size, head_dim, num_kv_heads, group,
                                                                   context_lens, splits, norm, cache, dtype):
    """Given the rotary inputs, the decode kernel does the rotary kernel's work too (q/k norm, rotary,
    storing the new key and value): it attends as the twins do (apply_rotary_ref, then attention)
    and leaves the caches as the rotary kernel does. The new token's slot holds NaN until then, so
    reading it before it is written fails. (In the fp8 tests' file for the interpreter's rounding fix.)"""
    k_cache, v_cache, block_tables, _ = make_paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype)
    num_seqs, scale = len(context_lens), head_dim ** -0.5
    lens = torch.tensor(context_lens, device=DEVICE)
    positions = (lens - 1).clamp(min=0)
    slots = new_token_slots(block_tables, context_lens, block_size)
    for c in (k_cache, v_cache):
        c.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]] = float("nan")
    k_scale = v_scale = None
    if cache != "16-bit":
        k_scale, v_scale = (torch.rand(num_kv_heads if cache == "fp8-head" else 1, device=DEVICE) * 0.02 + 0.005
                            for _ in range(2))
        k_cache, v_cache = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
    _, q, k, v = packed_qkv(num_seqs, num_kv_heads * group, num_kv_heads, head_dim, dtype)
    q_before, k_before = q.clone(), k.clone()
    weights = (torch.randn(head_dim, device=DEVICE).to(dtype), torch.randn(head_dim, device=DEVICE).to(dtype)) \
        if norm else None
    rotary = RotaryInputs(positions, RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to(DEVICE), weights, EPS)
    caches, caches_twin, caches_rotary = ((k_cache.clone(), v_cache.clone()) for _ in range(3))

    out = paged_decode_attention(q, *caches, lens, block_tables, scale, num_splits=splits, k_scale=k_scale,
                                 v_scale=v_scale, rotary=rotary, new_kv=(k, v, slots))
    ref = paged_decode_attention_ref(q, *caches_twin, lens, block_tables, scale, k_scale, v_scale, rotary=rotary,
                                     new_kv=(k, v, slots))
    apply_rotary(positions, q.clone(), k.clone(), rotary.cos_sin_cache, weights, EPS,
                 KVStore(v, *caches_rotary, slots, k_scale, v_scale))

    real = lens > 0
    assert_close(out[real], ref[real], dtype)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))     # a padding row reads and writes nothing
    assert torch.equal(q, q_before) and torch.equal(k, k_before)     # rotated in registers only
    bits = torch.uint8 if cache != "16-bit" else torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(caches[1].view(bits), caches_rotary[1].view(bits))   # values: the same bits, NaN where unused
    # keys: the same math as the rotary kernel's, so the same bits but for the compiler's choice of
    # fused multiply-adds (at most one step of the cache's type)
    k_kernel, k_rotary = (c.view(-1, num_kv_heads, head_dim)[slots[real]] for c in (caches[0], caches_rotary[0]))
    torch.testing.assert_close(k_kernel.float(), k_rotary.float(),
                               **(dict(atol=2 ** -9, rtol=2 ** -3) if cache != "16-bit" else TOL[dtype]))
    rest = torch.ones(caches[0].numel() // head_dim, dtype=torch.bool, device=DEVICE)
    rest[slots[real].repeat_interleave(num_kv_heads) * num_kv_heads
         + torch.arange(num_kv_heads, device=DEVICE).repeat(int(real.sum()))] = False
    assert torch.equal(caches[0].view(-1, head_dim)[rest].view(bits), k_cache.view(-1, head_dim)[rest].view(bits))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")   # NaN-poisoned slots the kernel masks out
@pytest.mark.parametrize("cache", ["16-bit", "fp8"])
def test_triton_backend_rotates_inside_decode_attention_for_small_decodes(monkeypatch, cache):
    """A decode step of at most ROTARY_IN_DECODE_MAX_SEQS sequences takes the one-kernel path; the
    layer's output and cache are those of the rotary kernel then attention."""
    from nanovllm.attention import triton as triton_backend, use_metadata
    from nanovllm.layers.attention import Attention
    context_lens, num_kv_heads, head_dim = [5, 40, 17], 2, 64
    k_cache, v_cache, block_tables, _ = make_paged_cache(context_lens, 16, num_kv_heads, head_dim, torch.float32)
    lens = torch.tensor(context_lens, device=DEVICE)
    slots = new_token_slots(block_tables, context_lens, 16)
    k_scale, v_scale = scales([0.01, 0.02]), scales([0.03, 0.015])       # per KV head
    if cache == "fp8":
        k_cache, v_cache = quantize_fp8(k_cache, k_scale), quantize_fp8(v_cache, v_scale)
    _, q, k, v = packed_qkv(len(context_lens), 2 * num_kv_heads, num_kv_heads, head_dim, torch.float32)
    backend = triton_backend.TritonAttention(NUM_SMS, num_kv_heads, k_cache.dtype)
    rotary_emb = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    took_fused_path = []
    rotate_and_attend = backend.rotate_and_attend

    def recording(*args):
        out = rotate_and_attend(*args)
        took_fused_path.append(out is not None)
        return out
    monkeypatch.setattr(backend, "rotate_and_attend", recording)

    def step(max_seqs):
        monkeypatch.setattr(triton_backend, "ROTARY_IN_DECODE_MAX_SEQS", max_seqs)
        attn = Attention(2 * num_kv_heads, num_kv_heads, head_dim, head_dim ** -0.5)
        attn.k_cache, attn.v_cache, attn.backend = k_cache.clone(), v_cache.clone(), backend
        if cache == "fp8":
            attn.k_scale, attn.v_scale = k_scale, v_scale
        with use_metadata(backend.decode_metadata(slots, lens, block_tables)):
            out = attn(lens - 1, q.clone(), k.clone(), v, rotary_emb)
        return out, attn.k_cache, attn.v_cache

    fused, separate = step(16), step(2)
    assert took_fused_path == [True, False]    # 3 sequences: within 16, above 2
    out, *caches = fused
    assert_close(out, separate[0], torch.float32)
    for a, b, before in zip(caches, separate[1:], (k_cache, v_cache)):
        a, b, before = (c.float().nan_to_num(7.0) for c in (a, b, before))
        if cache == "fp8":    # the same math: at most one e4m3 step apart (fused multiply-adds)
            torch.testing.assert_close(a, b, atol=2 ** -9, rtol=2 ** -3)
        else:
            assert_close(a, b, torch.float32)
        assert not torch.equal(a, before)     # the new tokens were stored


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9,
                    reason="the register cap is measured and applied on Hopper GPUs only")
def test_fp8_decode_kernel_keeps_to_the_register_cap_on_hopper(monkeypatch):
    """Uncapped, the float8 decode kernel took 193 registers per thread at the default tile, and
    two programs fit on an SM; capped it must take at most FP8_DECODE_MAX_REGISTERS without spilling.
    The 16-bit kernel keeps the compiler's choice."""
    kernel, launches = paged_attention._decode_kernel, []

    class RecordingKernel:   # a launch returns the compiled kernel, which knows its registers
        def __getitem__(self, grid):
            return lambda *args, **options: launches.append((options, kernel[grid](*args, **options)))

    monkeypatch.setattr(paged_attention, "_decode_kernel", RecordingKernel())
    k_scale, v_scale = scales([0.01]), scales([0.02])
    k8, v8, block_tables, _ = fp8_paged_cache([300, 17], 256, 8, 128, k_scale, v_scale)
    lens = torch.tensor([300, 17], device=DEVICE)
    q = torch.randn(2, 16, 128, dtype=torch.bfloat16, device=DEVICE)
    paged_decode_attention(q, k8, v8, lens, block_tables, 128 ** -0.5, num_splits=1, k_scale=k_scale, v_scale=v_scale)
    bf16 = k8.to(torch.bfloat16)
    paged_decode_attention(q, bf16, bf16, lens, block_tables, 128 ** -0.5, num_splits=1)

    (fp8_options, fp8_kernel), (bf16_options, _) = launches
    cap = paged_attention.FP8_DECODE_MAX_REGISTERS
    assert fp8_options["maxnreg"] == cap and fp8_kernel.n_regs <= cap and fp8_kernel.n_spills == 0
    assert "maxnreg" not in bf16_options


@triton.jit
def _unpack_words_kernel(words_ptr, even_ptr, odd_ptr, N: tl.constexpr, PTX: tl.constexpr):
    i = tl.arange(0, N)
    words = tl.load(words_ptr + i)
    tl.store(even_ptr + i, paged_attention._e4m3_byte_to_f16(words, False, PTX))
    tl.store(odd_ptr + i, paged_attention._e4m3_byte_to_f16(words, True, PTX))


@needs_triton
@pytest.mark.parametrize("ptx", [False] + ([True] if CUDA and torch.cuda.get_device_capability()[0] >= 9 else []),
                         ids=lambda p: "ptx" if p else "shifts")
def test_decode_kernel_reads_both_e4m3_bytes_of_every_16_bit_word(ptx):
    """The decode kernel reads float8 values as 16-bit words of two (see _decode_kernel): every word,
    all 256 x 256 byte pairs, must give torch's float16 of its first byte (the even dimension) and
    of its second (the odd one). NaN codes too on the GPU; the interpreter's e4m3 -> float conversion is
    right for the finite codes only, and the kernel never reads others (stores clamp, masks give 0)."""
    values = torch.arange(256 * 256, dtype=torch.int32).to(torch.uint16).view(torch.int16).to(DEVICE)
    even, odd = (torch.empty(values.shape, dtype=torch.float16, device=DEVICE) for _ in range(2))
    _unpack_words_kernel[(1,)](values, even, odd, N=values.numel(), PTX=ptx)
    expected = values.view(FP8_DTYPE).view(-1, 2).to(torch.float16)   # little-endian: byte 0 is the even one
    checked = torch.ones_like(expected, dtype=torch.bool) if CUDA else ~expected.isnan()
    for got, column in ((even, 0), (odd, 1)):
        rows = checked[:, column]
        torch.testing.assert_close(got[rows], expected[rows, column], rtol=0, atol=0, equal_nan=True)


def test_decode_splits_for_fp8_aim_at_four_programs_an_sm_rounded_to_the_nearest():
    assert decode_num_splits(16, 8, 132) == 2 and decode_num_splits(16, 8, 132, torch.bfloat16) == 2
    assert decode_num_splits(16, 8, 132, FP8_DTYPE) == 4          # 4 * 132 / 128 = 4.1
    assert decode_num_splits(48, 8, 132, FP8_DTYPE) == 1          # 1.4: rounded down, where 16-bit rounds up
    assert decode_num_splits(32, 8, 132, FP8_DTYPE) == 2          # 2.06
    assert decode_num_splits(256, 8, 132, FP8_DTYPE) == 1
    assert decode_num_splits(1, 8, 132, FP8_DTYPE) == 16 and decode_num_splits(8, 8, 132, FP8_DTYPE) == 8


# ---------------------------------------------------------------- paged prefill attention

PREFILL_SMALL = [  # chunks: (cached tokens, new query tokens) per sequence
    pytest.param(16, 64, 2, 2, [(0, 5), (8, 20), (48, 30), (15, 1)], [0.01, 0.02], [0.3, 0.004], id="block16-gqa2-head_scales"),
    pytest.param(32, 128, 1, 4, [(40, 9), (0, 17), (33, 16)], [0.0123], [0.0321], id="block32-gqa4-layer_scale"),
]
PREFILL_FULL = PREFILL_SMALL + [
    pytest.param(256, 128, 8, 2, [(0, 5), (8, 200), (3000, 512), (255, 1), (1024, 64)], [0.01] * 8,
                 [0.02 + 0.001 * h for h in range(8)], id="block256-gqa2-head_scales"),
]


@needs_triton
@query_dtypes
@pytest.mark.parametrize("block_size,head_dim,num_kv_heads,group,chunks,k_scale,v_scale",
                         PREFILL_FULL if CUDA else PREFILL_SMALL)
def test_paged_prefill_attention_over_fp8_cache(block_size, head_dim, num_kv_heads, group, chunks, k_scale, v_scale,
                                                dtype):
    k_scale, v_scale = scales(k_scale), scales(v_scale)
    context_lens = [cached + q_len for cached, q_len in chunks]
    k8, v8, block_tables, _ = fp8_paged_cache(context_lens, block_size, num_kv_heads, head_dim, k_scale, v_scale)
    q_lens = [q_len for _, q_len in chunks]
    cu_seqlens_q = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).int()
    scale = head_dim ** -0.5
    _, q, _, _ = packed_qkv(sum(q_lens), num_kv_heads * group, num_kv_heads, head_dim, dtype)
    q.mul_(2)
    lens = torch.tensor(context_lens, device=DEVICE)

    out = paged_prefill_attention(q, k8, v8, cu_seqlens_q, max(q_lens), lens, block_tables, scale,
                                  k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_ref(q, k8, v8, cu_seqlens_q, lens, block_tables, scale, k_scale, v_scale)

    assert_close(out, ref, dtype)
    stored = dequantized_dense(k8, v8, block_tables, context_lens, k_scale, v_scale)
    for (k, v), start, end in zip(stored, cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        assert_close(ref[start:end], dense_attention(q[start:end], k, v, scale), dtype)


# ---------------------------------------------------------------- the attention layer passes the scales on

def test_attention_layer_stores_and_reads_an_fp8_cache_with_its_scales():
    """The attention layer stores its keys and values with the cache's scales, and the CPU backend
    reads the cache with them: a decode step over one stored token returns that token's
    dequantised value."""
    from nanovllm.attention import AttentionMetadata, use_metadata
    from nanovllm.attention.torch_reference import TorchAttention
    from nanovllm.layers.attention import Attention
    attn = Attention(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.3)
    attn.k_cache = torch.full((2, 4, 2, 8), float("nan")).to(FP8_DTYPE)
    attn.v_cache = attn.k_cache.clone()
    attn.k_scale, attn.v_scale = torch.tensor([0.02, 0.05]), torch.tensor([0.1, 0.01])
    k, v = torch.randn(2, 1, 2, 8)
    attn.backend = TorchAttention()
    with use_metadata(AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor([4]), context_lens=torch.tensor([1]),
                                        block_tables=torch.tensor([[1]]))):
        out = attn(torch.tensor([0]), torch.randn(1, 4, 8), k, v, RotaryEmbedding(8, 16, 1e4))
    assert torch.equal(attn.v_cache[1, 0].view(torch.uint8), quantize_fp8(v[0], attn.v_scale).view(torch.uint8))
    assert torch.equal(attn.k_cache[1, 0].view(torch.uint8), quantize_fp8(k[0], attn.k_scale).view(torch.uint8))
    expected_v = dequantize_fp8(quantize_fp8(v, attn.v_scale), attn.v_scale, torch.float32)   # one key: softmax = 1
    assert torch.equal(out.view(4, 8), expected_v[0].repeat_interleave(2, 0))
    assert not torch.equal(expected_v, v)   # the storage did round
