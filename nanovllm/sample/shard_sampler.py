"""Sampling under tensor parallelism without gathering the vocabulary, for steps whose rows are all
greedy or plain temperature sampling (no filters, bans, masks or logprobs: those need every logit).

Each rank sums up its vocabulary shard's logits as a few candidates per row (kernels/shard_sampling.py),
the ranks all-gather them, and each picks the same token, the one a single rank would have sampled
from the whole vocabulary with the same seed. One all-gather of [rows, vocab / 4096, 3] float32 per
step (of [rows, 1, 3] for an all-greedy step, or on the CPU) instead of gathering [rows, vocab]
logits to rank 0.
"""
import torch
import torch.distributed as dist

from nanovllm.kernels.shard_sampling import (pick_token, shard_argmax_candidates, shard_candidates,
                                             shard_candidates_ref)


def sample_shard(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, all_greedy: bool,
                 vocab_start: int, vocab_size: int, group=None) -> torch.Tensor:
    """logits: [rows, shard] of vocabulary ids vocab_start.. (the last rank's padding columns past the
    vocabulary included); temperatures and seeds as SamplingTensors'. The [rows] sampled ids, the
    same on every rank of the tensor-parallel group."""
    candidates = shard_candidates_for(logits, temperatures, seeds, all_greedy, vocab_start, vocab_size)
    gathered = [torch.empty_like(candidates) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, candidates, group=group)
    return pick_token(torch.stack(gathered), temperatures == 0)


def shard_candidates_for(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, all_greedy: bool,
                         vocab_start: int, vocab_size: int) -> torch.Tensor:
    """This rank's candidates (kernels/shard_sampling.py); padding columns never take part."""
    logits = logits[:, :vocab_size - vocab_start]
    if all_greedy:
        return shard_argmax_candidates(logits, vocab_start)
    if logits.is_cuda:
        return shard_candidates(logits, temperatures, seeds, vocab_start, vocab_size)
    return shard_candidates_ref(logits, temperatures, seeds.tolist(), vocab_start, vocab_size)
