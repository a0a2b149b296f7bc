"""Applying packed token bitmasks to logits: the Triton kernel (under TRITON_INTERPRET=1 off CUDA)
and its torch twin against a plain loop over the bits, in float32 and float16, with some rows
constrained and others left alone, a vocabulary that is not a multiple of 32, and one wider than
the bitmask."""
import os

import pytest
import torch

from nanovllm.kernels.token_bitmask import BLOCK, apply_token_bitmask, apply_token_bitmask_ref
from nanovllm.kernels.triton_compat import HAS_TRITON

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_RUNS = HAS_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not KERNEL_RUNS, reason="needs triton on CUDA or TRITON_INTERPRET=1")


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit by bit: token t of logits row rows[i] is -inf unless bit t % 32 of word t // 32 of
    bitmask row i is set (tokens past the bitmask are not allowed)."""
    out = logits.clone()
    words = bitmask.tolist()
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= len(words[i]) or not (words[i][w] >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


def case(num_rows: int, vocab_size: int, num_words: int, rows: list[int], dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(dtype)
    # sparse, dense, empty and full words, as grammars make them
    density = torch.rand(len(rows), 1, generator=generator)
    allowed = torch.rand(len(rows), num_words * 32, generator=generator) < density
    if len(rows) > 1:
        allowed[0] = True
    packed = (allowed.view(len(rows), num_words, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return logits, bitmask, rows


CASES = [
    (4, 100, 4, [0, 1, 2, 3]),            # every row; vocabulary not a multiple of 32
    (6, 200, 7, [4, 1]),                   # a few rows, out of order
    (3, 170, 5, [2]),                      # logits wider than the bitmask (160 tokens): the rest banned
    (2, BLOCK + 77, -(-(BLOCK + 77) // 32), [1, 0]),   # more than one program per row
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows,vocab_size,num_words,rows", CASES)
def test_torch_twin_matches_the_bits(num_rows, vocab_size, num_words, rows, dtype):
    logits, bitmask, rows = case(num_rows, vocab_size, num_words, rows, dtype, seed=vocab_size)
    want = expected(logits, bitmask, rows)
    apply_token_bitmask_ref(logits, bitmask, torch.tensor(rows, dtype=torch.int32))
    assert torch.equal(logits, want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows,vocab_size,num_words,rows", CASES)
def test_kernel_matches_torch_twin(num_rows, vocab_size, num_words, rows, dtype):
    logits, bitmask, rows = case(num_rows, vocab_size, num_words, rows, dtype, seed=vocab_size + 1)
    twin = logits.clone()
    apply_token_bitmask_ref(twin, bitmask, torch.tensor(rows, dtype=torch.int32))
    logits, bitmask = logits.to(DEVICE), bitmask.to(DEVICE)
    apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int32, device=DEVICE))
    assert torch.equal(logits.cpu(), twin)
    assert torch.isinf(twin).any() and torch.isfinite(twin).any()    # the case masks something, not all


@needs_kernel
def test_no_rows_leaves_logits_alone():
    logits = torch.randn(3, 64, device=DEVICE)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32, device=DEVICE),
                        torch.zeros(0, dtype=torch.int32, device=DEVICE))
    assert torch.equal(logits, before)
