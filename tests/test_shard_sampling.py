"""Sampling on vocabulary shards (kernels/shard_sampling.py, sample/shard_sampler.py) without the
ranks: each shard's candidates, stacked as the all-gather stacks them, pick exactly the token that
gumbel_argmax (the Triton kernel) or gumbel_argmax_ref (its twin) picks over the whole vocabulary,
for greedy and sampled rows, shards that split a CHUNK, and a last shard padded past the vocabulary
(its padding never wins). The engine over two ranks: tests/test_tensor_parallel.py."""
import os

import pytest
import torch

from nanovllm.kernels.sampling import CHUNK, gumbel_argmax, gumbel_argmax_ref
from nanovllm.kernels.shard_sampling import pick_token, shard_candidates
from nanovllm.kernels.triton_compat import HAS_TRITON
from nanovllm.sample.shard_sampler import shard_candidates_for

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KERNEL_RUNS = HAS_TRITON and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not KERNEL_RUNS, reason="needs triton on CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])   # the interpreter lacks bf16
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
# (vocabulary, ranks): shards inside one chunk, a shard boundary inside a chunk, on a chunk
# boundary, and a vocabulary that does not divide (the last shard padded)
SHAPES = [(100, 2), (CHUNK + 904, 2), (2 * CHUNK, 2), (3 * CHUNK + 7, 4)]
PADDING_SCORE = 1e4     # what a padding column would win with, were it not cut off


def batch(vocab: int, dtype: torch.dtype, rows: int = 24):
    """Scores with a few planted cases, temperatures (every fourth row greedy) and seeds."""
    generator = torch.Generator().manual_seed(vocab)
    scores = torch.randn(rows, vocab, generator=generator) * 2
    scores[0] = 0                                   # greedy, all tied: the first id
    scores[4, [vocab // 2 - 1, vocab - 1]] = 30     # greedy, tied across shards: the first of them
    scores[8, -1] = 30                              # greedy, the last id
    scores[1, vocab - 1] = 60                       # sampled, all mass on the last id
    temperatures = torch.rand(rows, generator=generator) + 0.3
    temperatures[::4] = 0
    seeds = torch.randint(0, 2**62, (rows,), generator=generator)
    return scores.to(DEVICE, dtype), temperatures.to(DEVICE), seeds.to(DEVICE)


def shards(scores: torch.Tensor, num_ranks: int):
    """(vocab_start, logits) of each rank, as the LM head leaves them: the last padded to the
    common shard width with columns that would win."""
    vocab = scores.shape[1]
    width = -(-vocab // num_ranks)
    padded = torch.full((scores.shape[0], width * num_ranks), PADDING_SCORE, dtype=scores.dtype, device=scores.device)
    padded[:, :vocab] = scores
    return [(rank * width, padded[:, rank * width:(rank + 1) * width]) for rank in range(num_ranks)]


@needs_kernel
@dtypes
@pytest.mark.parametrize("vocab, num_ranks", SHAPES, ids=lambda v: str(v))
def test_kernel_shards_pick_what_gumbel_argmax_picks(vocab, num_ranks, dtype):
    scores, temperatures, seeds = batch(vocab, dtype)
    candidates = torch.stack([shard_candidates(logits[:, :vocab - start], temperatures, seeds, start, vocab)
                              for start, logits in shards(scores, num_ranks)])
    tokens = pick_token(candidates, temperatures == 0)
    assert torch.equal(tokens, gumbel_argmax(scores, temperatures, seeds))
    assert tokens[[0, 4, 8, 1]].tolist() == [0, vocab // 2 - 1, vocab - 1, vocab - 1]


@dtypes
@pytest.mark.parametrize("vocab, num_ranks", SHAPES, ids=lambda v: str(v))
def test_twin_shards_pick_what_gumbel_argmax_ref_picks(vocab, num_ranks, dtype):
    """The CPU path (shard_candidates_for on the CPU uses the twin), padding columns and all."""
    scores, temperatures, seeds = (t.cpu() for t in batch(vocab, dtype))
    candidates = torch.stack([shard_candidates_for(logits, temperatures, seeds, False, start, vocab)
                              for start, logits in shards(scores, num_ranks)])
    tokens = pick_token(candidates, temperatures == 0)
    assert torch.equal(tokens, gumbel_argmax_ref(scores, temperatures, seeds.tolist()))
    assert tokens[[0, 4, 8, 1]].tolist() == [0, vocab // 2 - 1, vocab - 1, vocab - 1]


@pytest.mark.parametrize("vocab, num_ranks", SHAPES, ids=lambda v: str(v))
def test_all_greedy_shards_pick_the_first_argmax(vocab, num_ranks):
    scores, _, _ = batch(vocab, torch.float32)
    temperatures, seeds = torch.zeros(len(scores), device=DEVICE), torch.zeros(len(scores), dtype=torch.int64,
                                                                               device=DEVICE)
    candidates = torch.stack([shard_candidates_for(logits, temperatures, seeds, True, start, vocab)
                              for start, logits in shards(scores, num_ranks)])
    assert torch.equal(pick_token(candidates, temperatures == 0), scores.argmax(dim=-1))
