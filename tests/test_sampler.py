"""The sampler against hand-computed masks, softmax and log_softmax: greedy rows, the min_p / top_k /
top_p filters and their order, banned tokens, per-row seeds, sampled distributions, logprobs, the
Gumbel-max Triton kernel against its torch twin, and SamplingParams validation.

Big-sample checks draw one token per row from many rows that share logits but not seeds; seeds are
fixed, so each check is deterministic on a given device."""
import math
import os

import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.kernels.sampling import CHUNK, gumbel_argmax, gumbel_argmax_ref
from nanovllm.kernels.triton_compat import HAS_TRITON
from nanovllm.sample.sampler import Sampler, SamplingTensors, filter_probs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_RUNS = HAS_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not KERNEL_RUNS, reason="needs triton on CUDA or TRITON_INTERPRET=1")

# eight tokens, not sorted, far enough apart that no filter decision below sits on a threshold
LOGITS_8 = [1.2, -0.3, 2.0, 0.4, -1.0, 1.6, 0.0, 0.9]


def distinct_seeds(n: int, salt: int = 0) -> torch.Tensor:
    """n different 62-bit seeds, scattered (an odd multiplier is a bijection modulo 2**62)."""
    return torch.tensor([(i * 0x9E3779B97F4A7C15 + salt * 0x632BE59BD9B4E019) % 2**62 for i in range(n)])


FILTER_DTYPES = {"top_k": torch.int64, "top_p": torch.float32, "min_p": torch.float32}


def sampling(temperatures: list[float], seeds: torch.Tensor | None = None, **kwargs) -> SamplingTensors:
    """SamplingTensors on DEVICE; filters given as per-row lists, other fields passed through."""
    seeds = distinct_seeds(len(temperatures)) if seeds is None else seeds
    for name, dtype in FILTER_DTYPES.items():
        if name in kwargs:
            kwargs[name] = torch.tensor(kwargs[name], dtype=dtype, device=DEVICE)
    return SamplingTensors(torch.tensor(temperatures, dtype=torch.float32, device=DEVICE), seeds.to(DEVICE), **kwargs)


def reference_probs(logits: list[float], temperature: float, min_p: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0) -> list[float]:
    """softmax(logits / T), then min_p, top_k, top_p on what is left, renormalised; written as plain
    loops over the sorted tokens, and refusing inputs whose decisions sit within 1e-4 of a threshold."""
    p = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1).tolist()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(range(len(p)))
    if min_p > 0:
        threshold = min_p * max(p)
        assert all(abs(x - threshold) > 1e-4 for x in p), "borderline min_p case"
        keep = {i for i in keep if p[i] >= threshold}
    if top_k > 0:
        keep = set([i for i in order if i in keep][:top_k])
    if top_p < 1:
        total, mass, kept = sum(p[i] for i in keep), 0.0, set()
        for i in [i for i in order if i in keep]:
            kept.add(i)
            mass += p[i] / total
            assert abs(mass - top_p) > 1e-4, "borderline top_p case"
            if mass >= top_p:
                break
        keep = kept
    total = sum(p[i] for i in keep)
    return [p[i] / total if i in keep else 0.0 for i in range(len(p))]


def assert_frequencies_match(tokens: torch.Tensor, expected: list[float], sigmas: float = 4.5) -> None:
    """Every count is within `sigmas` binomial standard deviations (at least `sigmas` counts) of n * p;
    exact where p is 0 or 1."""
    n = tokens.numel()
    counts = torch.bincount(tokens.cpu(), minlength=len(expected)).tolist()
    assert len(counts) == len(expected), f"token outside the vocabulary: {counts}"
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p in (0.0, 1.0):
            assert count == n * p, f"token {token} of probability {p} drawn {count} of {n} times"
            continue
        z = (count - n * p) / max(math.sqrt(n * p * (1 - p)), 1.0)   # at least one count of slack
        assert abs(z) < sigmas, f"token {token}: {count} of {n}, expected p={p:.4f} (z={z:.1f}); {counts}"


def draw_many(logits: list[float], n: int, temperature: float, salt: int = 0, **filters) -> torch.Tensor:
    """One token from each of n rows with the same logits and n different seeds."""
    batch = torch.tensor([logits], device=DEVICE).repeat(n, 1)
    kwargs = {k: [v] * n for k, v in filters.items()}
    return Sampler()(batch, sampling([temperature] * n, distinct_seeds(n, salt), **kwargs)).token_ids


def kept(probs: torch.Tensor, min_p=None, top_k=None, top_p=None) -> list[list[int]]:
    """filter_probs on one row per filter value; the kept token ids of each row, largest first."""
    rows = len(next(v for v in (min_p, top_k, top_p) if v is not None))
    batch = probs.to(DEVICE).repeat(rows, 1)
    def as_tensor(values, dtype):
        return None if values is None else torch.tensor(values, dtype=dtype, device=DEVICE)

    out = filter_probs(batch, as_tensor(min_p, torch.float32), as_tensor(top_k, torch.int64),
                       as_tensor(top_p, torch.float32))
    nonzero = out != 0
    assert torch.equal(out[nonzero], batch[nonzero]), "kept probabilities must be left as they were"
    return [sorted(row.nonzero().flatten().tolist(), key=lambda i: -probs[i].item()) for row in nonzero.cpu()]


# ---- greedy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filters", [{}, dict(top_k=[3] * 6, top_p=[0.9] * 6, min_p=[0.1] * 6)],
                         ids=["plain", "filtered"])
def test_temperature_zero_rows_return_argmax_in_a_mixed_batch(dtype, filters):
    """Temperature-0 rows give exactly argmax(logits), beside sampled rows, with and without filters."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randperm(200, generator=generator) for _ in range(6)]).to(dtype) / 8
    temperatures = [0.0, 1.0, 0.0, 0.7, 0.0, 1.5]
    out = Sampler()(logits.to(DEVICE), sampling(temperatures, **filters)).token_ids.cpu()
    greedy = [row for row, t in enumerate(temperatures) if t == 0]
    assert out[greedy].tolist() == [max(range(200), key=lambda i: logits[row, i].item()) for row in greedy]
    assert all(0 <= t < 200 for t in out.tolist())


def test_all_greedy_batch_returns_argmax():
    """With all_greedy set, every row gives argmax(logits)."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.stack([torch.randperm(50, generator=generator) for _ in range(4)]).float()
    out = Sampler()(logits.to(DEVICE), sampling([0.0] * 4, torch.zeros(4, dtype=torch.int64), all_greedy=True))
    assert out.token_ids.cpu().tolist() == [row.tolist().index(49) for row in logits]


# ---- filters on hand-made probabilities -----------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest():
    """top_k = k keeps the k most likely tokens, unchanged, and zeroes the rest."""
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    assert kept(probs, top_k=[1, 2, 3, 4, 5]) == [[1], [1, 3], [1, 3, 4], [1, 3, 4, 0], [1, 3, 4, 0, 2]]


def test_top_p_keeps_the_smallest_set_reaching_p_including_the_crossing_token():
    """top_p keeps tokens until their mass reaches p: the crossing token stays, exact reach stops there."""
    # powers of two, so every partial mass is exact: sorted 1/2, 1/4, 3/16, 1/16
    probs = torch.tensor([0.0625, 0.5, 0.1875, 0.25])
    assert kept(probs, top_p=[0.4, 0.5, 0.6, 0.75, 0.76, 0.9375, 0.94, 1.0]) == [
        [1], [1], [1, 3], [1, 3], [1, 3, 2], [1, 3, 2], [1, 3, 2, 0], [1, 3, 2, 0]]
    # the spec's example, with p clearly on one side of each partial mass 0.5, 0.8, 0.95
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    assert kept(probs, top_p=[0.45, 0.6, 0.81, 0.96]) == [[1], [1, 3], [1, 3, 0], [1, 3, 0, 2]]


def test_min_p_keeps_tokens_at_least_min_p_times_the_max():
    """min_p keeps exactly the tokens with prob >= min_p * max prob (equality kept)."""
    probs = torch.tensor([0.125, 0.5, 0.25, 0.0625, 0.0625])
    assert kept(probs, min_p=[0.0, 0.25, 0.26, 0.5, 0.51, 1.0]) == [
        [1, 2, 0, 3, 4], [1, 2, 0], [1, 2], [1, 2], [1], [1]]


def test_top_p_applies_to_what_min_p_and_top_k_left():
    """min_p and top_k run before top_p, which measures mass over the survivors; other orders differ."""
    probs = torch.tensor([0.0625, 0.5, 0.1875, 0.25])   # sorted 1/2, 1/4, 3/16, 1/16
    # min_p 0.25 drops 1/16; top_p 0.78 on the survivors (1/2, 4/15, 1/5) stops at 0.8 -> 2 tokens.
    # top_p alone would keep 3 (mass 0.75 < 0.78), and top_p before min_p keeps 3 as well.
    assert kept(probs, min_p=[0.25], top_p=[0.78]) == [[1, 3]]
    assert kept(probs, top_p=[0.78]) == [[1, 3, 2]]
    # top_k 2 leaves (2/3, 1/3); top_p 0.6 stops at the first. top_p first would keep 2, then top_k 2.
    assert kept(probs, top_k=[2], top_p=[0.6]) == [[1]]
    assert kept(probs, top_p=[0.6]) == [[1, 3]]


def test_rows_with_filters_off_are_untouched():
    """Rows with top_k = vocab, top_p = 1 and min_p = 0 come back equal to their input, beside a filtered row."""
    probs = torch.softmax(torch.randn(3, 16, generator=torch.Generator().manual_seed(2)), -1).to(DEVICE)
    out = filter_probs(probs, torch.tensor([0.0, 0.2, 0.0], device=DEVICE),
                       torch.tensor([16, 3, 16], device=DEVICE), torch.tensor([1.0, 0.5, 1.0], device=DEVICE))
    assert torch.equal(out[0], probs[0]) and torch.equal(out[2], probs[2])
    assert (out[1] != 0).sum().item() <= 3
    assert torch.equal(filter_probs(probs, None, None, None), probs)
    # a far tail below float32 resolution of the cumulative mass survives top_p = 1 too
    tail = torch.tensor([[1.0, 1e-9], [0.5, 0.5]], device=DEVICE)
    assert torch.equal(filter_probs(tail, None, None, torch.tensor([1.0, 0.4], device=DEVICE))[0], tail[0])


def test_temperature_applies_before_min_p():
    """min_p compares probabilities after temperature: T=0.5 leaves one token, T=2 leaves three."""
    logits = [2.0, 1.0, 0.0]    # max-relative probs: T=1 (1, .37, .14), T=.5 (1, .14, .02), T=2 (1, .61, .37)
    cold = draw_many(logits, 300, 0.5, min_p=0.3)
    assert cold.unique().tolist() == [0]        # min_p before temperature would keep token 1 (~12%)
    hot = draw_many(logits, 300, 2.0, salt=1, min_p=0.3)
    assert_frequencies_match(hot, reference_probs(logits, 2.0, min_p=0.3))
    assert (hot == 2).any()                     # min_p before temperature would drop token 2


# ---- banned tokens (min_tokens) ---------------------------------------------------------------------

def test_banned_tokens_are_never_sampled_even_as_argmax():
    """Banned ids are never chosen, greedy or sampled, filtered or not; other rows and the logits stay as they were."""
    n = 64
    logits = torch.tensor([[0.0, 8.0, 1.0, 0.5, 7.5, 0.2]], device=DEVICE).repeat(n, 1)
    original = logits.clone()
    temperatures = [0.0, 0.0] + [1.0] * (n - 2)
    banned = {row: [1, 4] for row in range(1, n)}          # row 0 is free
    out = Sampler()(logits, sampling(temperatures, banned_tokens=banned)).token_ids.cpu()
    assert out[0].item() == 1 and out[1].item() == 2       # next best after banning 1 and 4
    assert not any(t in (1, 4) for t in out[1:].tolist())
    assert torch.equal(logits, original)
    # the filtered path: top_k 1 must pick the best token that is allowed
    top_k = [1] * n
    out = Sampler()(logits, sampling([1.0] * n, banned_tokens=banned, top_k=top_k)).token_ids.cpu()
    assert out[0].item() == 1 and set(out[1:].tolist()) == {2}


# ---- seeds ----------------------------------------------------------------------------------------

def test_same_seed_gives_same_tokens_and_different_seeds_differ():
    """Repeating a call with the same seeds repeats every token; other seeds draw other tokens."""
    n, vocab = 64, 1000
    logits = (0.1 * torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))).repeat(n, 1).to(DEVICE)
    first = Sampler()(logits, sampling([1.0] * n, distinct_seeds(n))).token_ids
    again = Sampler()(logits, sampling([1.0] * n, distinct_seeds(n))).token_ids
    other = Sampler()(logits, sampling([1.0] * n, distinct_seeds(n, salt=7))).token_ids
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert len(set(first.tolist())) > 40           # ~62 expected from 64 draws over a flat 1000


def test_seeded_row_does_not_depend_on_batch_or_position():
    """A seeded row draws the same token alone, moved to another row, or beside greedy and filtered rows."""
    n, vocab = 12, 40
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    seeds = distinct_seeds(n)
    top_k = [vocab] * (n - 2) + [5, 5]                       # the last two rows filter themselves
    alone = Sampler()(logits, sampling([0.9] * n, seeds, top_k=top_k)).token_ids
    plain = Sampler()(logits[:-2], sampling([0.9] * (n - 2), seeds[:-2])).token_ids
    # reversed, interleaved with a greedy row, a top_p row and an unrelated seed
    extra = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mixed = torch.cat([extra, logits.flip(0)])
    mixed_seeds = torch.cat([torch.tensor([11, 12, 13]), seeds.flip(0)])
    out = Sampler()(mixed, sampling([0.0, 1.0, 0.8] + [0.9] * n, mixed_seeds, top_k=[vocab] * 3 + top_k[::-1],
                                    top_p=[1.0, 0.5, 1.0] + [1.0] * n)).token_ids
    assert torch.equal(out[3:].flip(0), alone)
    assert torch.equal(plain, alone[:-2])
    # the same seed in two rows with the same logits gives the same token
    twice = Sampler()(logits[:1].repeat(2, 1), sampling([0.9, 0.9], seeds[:1].repeat(2))).token_ids
    assert twice.tolist() == [alone[0].item()] * 2


# ---- sampled distributions -------------------------------------------------------------------------

@pytest.mark.parametrize("filters", [
    {}, dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2), dict(min_p=0.05, top_k=5, top_p=0.8),
], ids=["none", "top_k", "top_p", "min_p", "all"])
def test_sampled_frequencies_match_filtered_softmax(filters):
    """20,000 seeded draws at T=0.7 match the filtered, renormalised softmax; filtered tokens never appear."""
    expected = reference_probs(LOGITS_8, 0.7, **filters)
    if filters:
        assert 0 < expected.count(0.0) < 7          # the case filters something, and leaves a choice
    assert_frequencies_match(draw_many(LOGITS_8, 20_000, 0.7, **filters), expected)


# ---- logprobs -------------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_of_raw_logits():
    """The chosen token's logprob and the top-N come from log_softmax of the raw logits, whatever the temperature."""
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out = Sampler()(logits, sampling([0.0, 0.5, 1.0, 1.5], top_k=[32, 4, 32, 32], max_logprobs=5))
    reference = torch.log_softmax(logits.double(), dim=-1)
    chosen = reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs.double(), chosen, rtol=0, atol=1e-5)
    values, ids = torch.topk(reference, 5, dim=-1)
    assert torch.equal(out.top_token_ids, ids)
    torch.testing.assert_close(out.top_logprobs.double(), values, rtol=0, atol=1e-5)
    none = Sampler()(logits, sampling([0.0, 0.5, 1.0, 1.5]))
    assert none.logprobs is None and none.top_logprobs is None and none.top_token_ids is None


# ---- the Triton kernel against its torch twin ---------------------------------------------------------

@needs_kernel
def test_gumbel_kernel_matches_twin_greedy_and_in_distribution():
    """The kernel gives argmax on temperature-0 rows like the twin, and samples softmax(x / T) over 256 seeds."""
    warm, cold = 192, 64                          # rows at T=0.7 and at T=0.1, all with LOGITS_8
    greedy = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    scores = torch.cat([greedy, torch.tensor([LOGITS_8]).repeat(warm + cold, 1)]).to(DEVICE)
    temperatures = torch.tensor([0.0] * 4 + [0.7] * warm + [0.1] * cold, device=DEVICE)
    seeds = distinct_seeds(len(scores)).to(DEVICE)
    tokens = gumbel_argmax(scores, temperatures, seeds)
    twin = gumbel_argmax_ref(scores, temperatures, seeds.tolist())
    assert tokens[:4].tolist() == twin[:4].tolist() == greedy.argmax(-1).tolist()
    for drawn in (tokens, twin):
        for rows, temperature in ((slice(4, 4 + warm), 0.7), (slice(4 + warm, None), 0.1)):
            expected = torch.softmax(torch.tensor(LOGITS_8, dtype=torch.float64) / temperature, -1).tolist()
            assert_frequencies_match(drawn[rows], expected)
    # per-row seeds: a few of the same rows, reversed and alone, draw the same tokens
    rows = torch.arange(4, 20).flip(0)
    again = gumbel_argmax(scores[rows].contiguous(), temperatures[rows], seeds[rows.to(DEVICE)])
    assert torch.equal(again, tokens[rows.to(DEVICE)])


@needs_kernel
def test_gumbel_kernel_reduces_across_vocabulary_chunks():
    """Over more than one CHUNK of vocabulary the best token may lie in any chunk; none past the end is drawn."""
    vocab = CHUNK + 8
    scores = torch.zeros(5, vocab)
    scores[0, CHUNK + 3] = 5.0                  # greedy, best in the second chunk
    scores[1, 5] = 5.0                          # greedy, best in the first chunk
    scores[2, CHUNK + 5] = 40.0                 # sampled, all mass on one token in the second chunk
    scores[3, 7] = 40.0                         # sampled, all mass on one token in the first chunk
    scores[4, :CHUNK + 6] = float("-inf")       # sampled, only the last two tokens allowed
    temperatures = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0], device=DEVICE)
    tokens = gumbel_argmax(scores.to(DEVICE), temperatures, distinct_seeds(5).to(DEVICE)).tolist()
    assert tokens[:4] == [CHUNK + 3, 5, CHUNK + 5, 7]
    assert tokens[4] in (CHUNK + 6, CHUNK + 7)


# ---- SamplingParams validation -----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=5, min_tokens=6), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_rejects_out_of_range_values(kwargs, name):
    """Each out-of-range argument raises ValueError whose message names it."""
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    (dict(top_k=2.5), "top_k"), (dict(max_tokens="8"), "max_tokens"), (dict(temperature=True), "temperature"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(seed=1.0), "seed"),
])
def test_sampling_params_rejects_wrong_types(kwargs, name):
    """An argument of the wrong type raises TypeError whose message names it."""
    with pytest.raises(TypeError, match=rf"^{name}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_the_boundaries():
    """The ends of every allowed range are accepted; temperature 0 is greedy and a single stop string becomes a list."""
    params = SamplingParams(temperature=0, top_p=1.0, min_p=1.0, top_k=-1, max_tokens=1, min_tokens=1,
                            logprobs=20, seed=0, stop="end")
    assert params.is_greedy and params.stop == ["end"] and isinstance(params.temperature, float)
    for kwargs in (dict(top_k=0), dict(min_p=0.0), dict(logprobs=0), dict(top_p=1e-6)):
        assert not SamplingParams(**kwargs).is_greedy
