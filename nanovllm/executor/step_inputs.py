"""A scheduled step as flat host arrays: what the model computes, where its K/V go, what it samples.

Token ids are real except for a sequence's pending token (sampled by the step still in flight and
not collected yet): it is encoded as a marker that tells the device which row of the last sampler
output to read (Worker.read_pending_tokens); core/step.py says how (pending_token_marker).
"""
from itertools import chain

import numpy as np

from nanovllm.core.sequence import Sequence
from nanovllm.core.step import ScheduledBatch, StepInputs, pending_token_marker


def step_token_ids(seq: Sequence, start: int, end: int) -> list[int]:
    """Input ids of seq's tokens [start, end), the pending one (if in range) as its marker."""
    ids = seq.token_ids[start:end]
    if seq.pending_row is not None and end == seq.num_tokens:
        ids.append(pending_token_marker(seq.pending_row))
    return ids


def padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), lens.max()), dtype=np.int64)
    out[np.arange(lens.max()) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int64,
                                                             count=int(lens.sum()))
    return out


def build_step_inputs(batch: ScheduledBatch, block_size: int) -> StepInputs:
    seqs = batch.seqs
    block_tables = padded_block_tables([seq.block_table for seq in seqs])
    if not batch.is_prefill and batch.draft_token_ids is None:   # one token per sequence, its last; all sample
        lens_and_tokens = np.array([(seq.num_tokens, seq.token_ids[-1] if seq.pending_row is None
                                     else pending_token_marker(seq.pending_row)) for seq in seqs], dtype=np.int64)
        context_lens, input_ids = lens_and_tokens[:, 0], lens_and_tokens[:, 1]
        positions = context_lens - 1
        slot_mapping = block_tables[np.arange(len(seqs)), positions // block_size] * block_size + positions % block_size
        cu_seqlens_q = np.arange(len(seqs) + 1)
        return StepInputs(False, input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, block_tables,
                          cu_seqlens_q[:-1], np.array(batch.block_copies, dtype=np.int64).reshape(-1, 2))
    # a prefill chunk, or a verify step: each sequence's last token and its proposals, like a short
    # chunk over its cached blocks, sampling at every position
    drafts = batch.draft_token_ids or [[]] * len(seqs)
    q_lens = np.array(batch.num_new_tokens, dtype=np.int64)
    starts = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
    context_lens = starts + q_lens
    cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_seqlens_q[1:])
    input_ids = np.concatenate([step_token_ids(seq, a, a + n - len(d)) + d
                                for seq, a, n, d in zip(seqs, starts, q_lens, drafts)])
    positions = np.arange(cu_seqlens_q[-1]) - np.repeat(cu_seqlens_q[:-1] - starts, q_lens)
    seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    if batch.draft_token_ids is not None:
        logits_indices = np.arange(cu_seqlens_q[-1])
        block_copies = np.array(batch.block_copies, dtype=np.int64).reshape(-1, 2)
    else:
        completes_prompt = context_lens == np.array([seq.num_tokens for seq in seqs])
        logits_indices, block_copies = cu_seqlens_q[1:][completes_prompt] - 1, np.zeros((0, 2), np.int64)
    return StepInputs(True, input_ids.astype(np.int64), positions, slot_mapping, context_lens,
                      cu_seqlens_q, block_tables, logits_indices, block_copies)
