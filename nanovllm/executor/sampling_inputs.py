"""The sampler's per-row tensors for the sequences a step samples (or, under tensor parallelism,
what each rank needs to sample its vocabulary shard), and the logprobs it returns."""
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from nanovllm.core.sequence import Sequence
from nanovllm.core.step import ShardSampling
from nanovllm.sample.sampler import SamplerOutput, SamplingTensors


def row_seeds(seqs: list[Sequence], all_greedy: bool, unseeded: np.random.Generator,
              offsets: list[int] | None = None) -> np.ndarray:
    """Each row's noise seed for this step: random, or for a seeded sequence one that depends only on
    its seed, its index among the request's n completions, and how many tokens it has made."""
    if all_greedy:
        return np.zeros(len(seqs), dtype=np.int64)
    seeds = unseeded.integers(0, 2**63 - 1, len(seqs))
    for row, seq in enumerate(seqs):
        seed = seq.sampling_params.seed
        if seed is not None:
            num_generated = seq.num_completion_tokens + (offsets[row] if offsets else 0)
            seeds[row] = xxhash.xxh64_intdigest(f"{seed}/{seq.index}/{num_generated}".encode()) >> 1
    return seeds


def build_sampling_tensors(seqs: list[Sequence], vocab_size: int, eos_token_ids: tuple[int, ...],
                           unseeded: np.random.Generator,
                           to_device: Callable[[np.ndarray], torch.Tensor],
                           offsets: list[int] | None = None) -> SamplingTensors:
    """One row per entry of seqs. A verify step lists a sequence once per position it samples, with
    `offsets` saying how many tokens past its current count each row stands."""
    params = [seq.sampling_params for seq in seqs]
    values = np.array([(p.temperature, p.top_p, p.min_p) for p in params], dtype=np.float64)
    temperatures, top_p, min_p = values.T
    top_k = np.array([min(p.top_k, vocab_size) if p.top_k > 0 else 0 for p in params], dtype=np.int64)
    all_greedy = not temperatures.any()
    seeds = row_seeds(seqs, all_greedy, unseeded, offsets)
    banned, asked = {}, []
    for row, p in enumerate(params):   # most rows ask for none of these; skip them cheaply
        if not p.min_tokens and p.logprobs is None:
            continue
        num_generated = seqs[row].num_completion_tokens + (offsets[row] if offsets else 0)
        if num_generated < p.min_tokens and p.structured_outputs is None:   # a grammar decides its end
            banned[row] = ([] if p.ignore_eos else list(eos_token_ids)) + p.stop_token_ids
        if p.logprobs is not None:
            asked.append(p.logprobs)
    sampling = SamplingTensors(to_device(temperatures.astype(np.float32)), to_device(seeds), all_greedy,
                               banned_tokens=banned, max_logprobs=max(asked) if asked else None)
    if (top_k > 0).any():
        sampling.top_k = to_device(np.where(top_k > 0, top_k, vocab_size))
    if (top_p < 1).any():
        sampling.top_p = to_device(top_p.astype(np.float32))
    if min_p.any():
        sampling.min_p = to_device(min_p.astype(np.float32))
    return sampling


def build_shard_sampling(seqs: list[Sequence], unseeded: np.random.Generator) -> ShardSampling | None:
    """What the tensor-parallel ranks need to sample their vocabulary shards (greedy or plain
    temperature rows), or None when a row needs every logit: logprobs, a top_k / top_p / min_p
    filter, or tokens min_tokens still bans. (Grammar masks come after launch: the executor asks.)"""
    for seq in seqs:
        p = seq.sampling_params
        if p.logprobs is not None or p.top_k > 0 or p.top_p < 1 or p.min_p > 0 or \
                seq.num_completion_tokens < p.min_tokens:
            return None
    temperatures = np.array([seq.sampling_params.temperature for seq in seqs], dtype=np.float32)
    return ShardSampling(temperatures, row_seeds(seqs, not temperatures.any(), unseeded))


def logprobs_by_row(out: SamplerOutput, seqs: list[Sequence]) -> list[dict[int, float] | None]:
    """Per sampled sequence that asked: its chosen token's logprob and its top alternatives."""
    if out.logprobs is None:
        return [None] * len(seqs)
    chosen, ids = out.token_ids.tolist(), out.top_token_ids.tolist()
    chosen_lp, top_lp = out.logprobs.tolist(), out.top_logprobs.tolist()
    result = []
    for row, seq in enumerate(seqs):
        n = seq.sampling_params.logprobs
        if n is None:
            result.append(None)
            continue
        entry = dict(zip(ids[row][:n], top_lp[row][:n]))
        entry[chosen[row]] = chosen_lp[row]
        result.append(entry)
    return result
