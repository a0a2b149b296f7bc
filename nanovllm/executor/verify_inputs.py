"""The host side of a verify step: one row per position each sequence samples."""
from collections.abc import Callable

import numpy as np
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.sample.rejection_sampler import VerifyTensors


def verify_rows(seqs: list[Sequence], drafts: list[list[int]]) -> tuple[list[Sequence], list[int]]:
    """Each sequence once per row (its k proposals and the bonus position), and the row's position."""
    row_seqs, positions = [], []
    for seq, proposal in zip(seqs, drafts):
        row_seqs += [seq] * (len(proposal) + 1)
        positions += range(len(proposal) + 1)
    return row_seqs, positions


def build_verify_tensors(drafts: list[list[int]], positions: list[int],
                         to_device: Callable[[np.ndarray], torch.Tensor]) -> VerifyTensors:
    draft_ids = np.fromiter((t for proposal in drafts for t in [*proposal, -1]), np.int64, len(positions))
    lens = np.array([len(proposal) + 1 for proposal in drafts], dtype=np.int64)
    return VerifyTensors(to_device(draft_ids), to_device(np.repeat(np.arange(len(drafts)), lens)),
                         to_device(np.asarray(positions, dtype=np.int64)), len(drafts))
