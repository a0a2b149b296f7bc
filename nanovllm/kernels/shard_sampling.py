"""Gumbel-max over one tensor-parallel rank's shard of the vocabulary that draws what
kernels/sampling.py draws over all of it, so the ranks agree on one rank's token without gathering
the logits.

A rank sums up its shard as candidates, [rows, chunks, 3] float32, one per CHUNK of the whole
vocabulary (a shard's first and last chunk may be shared with its neighbours):
  mass   its part of the chunk's log2-sum-exp2 of scores / temperature, plus the chunk's noise
  score  the best noisy score (greedy rows: the best score) among its tokens of the chunk
  token  that token's id in the whole vocabulary (exact in float32 below 2**24)
The ranks all-gather them and `pick_token` chooses alike on every rank: the chunk whose masses,
log2-sum-exp2'ed over the ranks, are highest, then its best score, ties to the lowest id; greedy
rows take the best score of any chunk. A chunk one rank holds whole keeps its mass bit for bit, so
the pick is gumbel_argmax's: the same Philox counters per (seed, token id) and per (seed, chunk),
the same arithmetic. Unlike gumbel_argmax, which draws token noise for the chosen chunk only, a
rank draws it for its whole shard, because choosing the chunk first would take a second collective
(neither cost measured on GPUs yet).

The twin mirrors gumbel_argmax_ref: noise for the whole vocabulary from a torch.Generator, of which
a shard takes its slice; the whole vocabulary is its one chunk.
"""
import torch

from nanovllm.kernels.sampling import CHUNK, _gumbel_noise
from nanovllm.kernels.triton_compat import pdl_launch, start_next_kernel, tl, triton, wait_for_previous_kernel

MAX_VOCAB = 2**24     # token ids travel as float32


@triton.jit
def _shard_candidates_kernel(scores_ptr, stride_row, temperatures_ptr, seeds_ptr, out_ptr, vocab_start, vocab_end,
                             num_chunks, first_chunk, CHUNK: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
                             FAST_LOG: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, chunk of the whole vocabulary that overlaps the shard)."""
    wait_for_previous_kernel(PDL)
    start_next_kernel(PDL)
    row = tl.program_id(0)
    chunk = first_chunk + tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)          # ids in the whole vocabulary
    mask = (offs >= vocab_start) & (offs < vocab_end)
    raw = tl.load(scores_ptr + row * stride_row + offs - vocab_start, mask=mask, other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    x = raw
    mass = tl.max(raw, axis=0)       # greedy rows: not read
    if temperature > 0:
        seed = tl.load(seeds_ptr + row)
        # the chunk's value as _chunk_summary_kernel computes it, plus its noise as _pick_token_kernel draws it
        scaled = raw * (1.4426950408889634 / temperature)
        best = tl.max(scaled, axis=0)
        total = tl.sum(tl.where(scaled > float("-inf"), tl.exp2(scaled - best), 0.0), axis=0)
        c = tl.arange(0, BLOCK_CHUNKS)
        chunk_noise = _gumbel_noise(seed, num_chunks * (CHUNK // 4), BLOCK_CHUNKS, FAST_LOG)
        mass = (best + tl.log2(total)) + tl.sum(tl.where(c == chunk, chunk_noise, 0.0), axis=0)
        x = raw * (1.4426950408889634 / temperature) + _gumbel_noise(seed, chunk * (CHUNK // 4), CHUNK, FAST_LOG)
        x = tl.where(mask, x, float("-inf"))
    out = out_ptr + (row * num_chunks + chunk) * 3
    tl.store(out, mass)
    tl.store(out + 1, tl.max(x, axis=0))
    tl.store(out + 2, (chunk * CHUNK + tl.argmax(x, axis=0)).to(tl.float32))


def shard_candidates(scores: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, vocab_start: int,
                     vocab_size: int) -> torch.Tensor:
    """scores: [rows, shard] of the vocabulary's ids vocab_start.. (no padding; last dim contiguous);
    temperatures [rows] float32, seeds [rows] int64 on its device. [rows, chunks, 3] candidates."""
    rows, width = scores.shape
    assert vocab_size < MAX_VOCAB
    num_chunks = triton.cdiv(vocab_size, CHUNK)
    first_chunk, last_chunk = vocab_start // CHUNK, (vocab_start + width - 1) // CHUNK
    out = torch.full((rows, num_chunks, 3), float("-inf"), device=scores.device)   # chunks of other shards
    _shard_candidates_kernel[(rows, last_chunk - first_chunk + 1)](
        scores, scores.stride(0), temperatures, seeds, out, vocab_start, vocab_start + width, num_chunks,
        first_chunk, CHUNK=CHUNK, BLOCK_CHUNKS=max(4, triton.next_power_of_2(num_chunks)), num_warps=8,
        FAST_LOG=scores.is_cuda,  # as gumbel_argmax: the interpreter lacks libdevice
        **pdl_launch(scores))
    return out


def shard_argmax_candidates(scores: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Candidates of a batch whose rows are all greedy: the shard's best score, one chunk."""
    x = scores.float()
    token = x.argmax(dim=-1, keepdim=True)
    return torch.stack([torch.zeros_like(x[:, :1]), x.gather(1, token), (token + vocab_start).float()], dim=-1)


def shard_candidates_ref(scores: torch.Tensor, temperatures: torch.Tensor, seeds: list[int], vocab_start: int,
                         vocab_size: int) -> torch.Tensor:
    """The twin: gumbel_argmax_ref's noise for the whole vocabulary, this shard's slice of it."""
    assert vocab_size < MAX_VOCAB
    candidates = shard_argmax_candidates(scores, vocab_start)
    shard = slice(vocab_start, vocab_start + scores.shape[1])
    for row, (temperature, seed) in enumerate(zip(temperatures.tolist(), seeds)):
        if temperature > 0:
            generator = torch.Generator(scores.device).manual_seed(seed)
            u = torch.rand(vocab_size, generator=generator, device=scores.device)
            gumbel = -torch.log(-torch.log(u))
            noisy = scores[row].float() / temperature + gumbel[shard]
            token = noisy.argmax()
            candidates[row, 0, 1:] = torch.stack([noisy[token], (token + vocab_start).float()])
    return candidates


def pick_token(candidates: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Every rank's candidates, [ranks, rows, chunks, 3], and which rows are greedy ([rows] bool):
    the token of each row, the same on every rank."""
    mass, score, token = candidates.unbind(-1)
    top = mass.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    chunk_mass = top + torch.log2(torch.exp2(mass - top).sum(dim=0))    # a chunk one rank holds: its mass, exactly
    chosen = chunk_mass.argmax(dim=-1, keepdim=True)                      # the first of equals, as tl.argmax
    chunks = torch.arange(mass.shape[-1], device=mass.device)
    in_play = greedy.unsqueeze(1) | (chunks == chosen)                    # [rows, chunks]
    score = score.masked_fill(~in_play, float("-inf"))
    best = score.amax(dim=(0, 2), keepdim=True)
    return token.masked_fill(score != best, float("inf")).amin(dim=(0, 2)).long()
