"""The host side of a verify step: one row per position each sequence samples, and its draws."""
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.spec_decode.rejection_sampler import VerifyTensors


def verify_rows(seqs: list[Sequence], drafts: list[list[int]]) -> tuple[list[Sequence], list[int]]:
    """Each sequence once per row (its k proposals and the bonus position), and the row's position."""
    row_seqs, positions = [], []
    for seq, proposal in zip(seqs, drafts):
        row_seqs += [seq] * (len(proposal) + 1)
        positions += range(len(proposal) + 1)
    return row_seqs, positions


def build_verify_tensors(seqs: list[Sequence], drafts: list[list[int]], unseeded: np.random.Generator,
                         to_device: Callable[[np.ndarray], torch.Tensor]) -> VerifyTensors:
    row_seqs, positions = verify_rows(seqs, drafts)
    draft_ids = np.fromiter((t for proposal in drafts for t in [*proposal, -1]), np.int64, len(row_seqs))
    lens = np.array([len(proposal) + 1 for proposal in drafts], dtype=np.int64)
    uniforms = unseeded.random(len(row_seqs))
    for row, (seq, position) in enumerate(zip(row_seqs, positions)):
        seed = seq.sampling_params.seed
        if seed is not None:   # like the sampler's noise: a function of seed, completion index and position
            key = f"{seed}/{seq.index}/{seq.num_completion_tokens + position}/accept".encode()
            uniforms[row] = xxhash.xxh64_intdigest(key) / 2.0**64
    return VerifyTensors(to_device(draft_ids), to_device(np.repeat(np.arange(len(seqs)), lens)),
                         to_device(np.asarray(positions, dtype=np.int64)), to_device(below_one(uniforms)),
                         len(seqs))


def below_one(uniforms: np.ndarray) -> np.ndarray:
    """As float32, still < 1 (rounding could reach 1, and 1 < p(x) = 1 would reject a certainty)."""
    return np.minimum(uniforms.astype(np.float32), np.nextafter(np.float32(1), np.float32(0)))
