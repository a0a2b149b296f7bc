"""Prompt logprobs (SamplingParams.prompt_logprobs): the logprob of each prompt token given the ones
before it, and the top k alternatives, as vLLM returns them.

A prefill step normally computes logits only for the last token of a finished prompt. For the
sequences that ask for prompt logprobs, the executor adds a logits row for every prompt position the
step computes (each chunk of a chunked prompt brings its own), after the sampled rows; position p's
row scores prompt token p + 1. Here those rows become float32 log-softmaxes on the device, only the
chosen tokens' values and the top k go to the host, and once the step is collected they are written
into each sequence's `prompt_logprobs` (entry 0, the first token, stays None). Such a sequence never
takes its prompt from the prefix cache until its first token is collected (Scheduler): cached
positions would have no logits. A step without such sequences costs one pass over its sequences.
"""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.core.step import ScheduledBatch, StepInputs

ROWS_PER_SLICE = 1024    # float32 log-softmax over this many rows at a time bounds its temporary memory


@dataclass(slots=True)
class PromptLogprobRows:
    """The prompt positions of one prefill step whose logprobs were asked for, and (once launched)
    host copies of their results, valid after `done`."""
    seqs: list[Sequence]
    first_positions: list[int]     # per sequence, its first position in this step with a row
    counts: list[int]              # and how many positions follow
    rows: np.ndarray               # their rows among the step's flat tokens
    targets: np.ndarray            # the prompt token each row scores (the one after its position)
    num_top: int                   # the largest k among the sequences
    logits_rows: np.ndarray | None = None    # where `rows` fall among the step's logits rows
    sampled_rows: np.ndarray | None = None   # and where the sampled rows fall among them
    chosen: torch.Tensor | None = None       # [rows] logprob of the target
    top_logprobs: torch.Tensor | None = None  # [rows, num_top]
    top_ids: torch.Tensor | None = None
    done: torch.cuda.Event | None = None


def plan_prompt_logprobs(batch: ScheduledBatch, inputs: StepInputs) -> PromptLogprobRows | None:
    """The rows a prefill step adds for prompt logprobs; None when no sequence of it asks."""
    if not batch.is_prefill or batch.draft_token_ids is not None:
        return None
    seqs, firsts, counts, rows, targets = [], [], [], [], []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        if not seq.needs_prompt_logprobs:
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)    # the last prompt position scores no prompt token
        if end <= start:
            continue
        seqs.append(seq)
        firsts.append(start)
        counts.append(end - start)
        rows.append(inputs.cu_seqlens_q[i] + np.arange(end - start))
        targets.append(seq.token_ids[start + 1:end + 1])
    if not seqs:
        return None
    return PromptLogprobRows(seqs, firsts, counts, np.concatenate(rows).astype(np.int64),
                             np.concatenate(targets).astype(np.int64),
                             max(seq.sampling_params.prompt_logprobs for seq in seqs))


def with_prompt_rows(logits_indices: np.ndarray, plan: PromptLogprobRows) -> np.ndarray:
    """The step's logits rows with the plan's added, in token order (a worker takes every row
    unselected when their count is the step's token count, so the order must be the tokens'). Sets
    where the plan's rows and the sampled rows fall among them."""
    rows = np.sort(np.concatenate([logits_indices, plan.rows]))     # disjoint: a prompt's last position
    plan.logits_rows = np.searchsorted(rows, plan.rows)              # is sampled, never scored
    plan.sampled_rows = np.searchsorted(rows, logits_indices)
    return rows


def split_prompt_rows(plan: PromptLogprobRows, logits: torch.Tensor,
                      to_device: Callable[[np.ndarray], torch.Tensor]) -> torch.Tensor:
    """Queue the prompt logprobs of a step's logits; the rows that remain to be sampled."""
    compute_prompt_logprobs(plan, logits[to_device(plan.logits_rows)], to_device)
    return logits[to_device(plan.sampled_rows)]


def compute_prompt_logprobs(plan: PromptLogprobRows, logits: torch.Tensor,
                            to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
    """Queue the log-softmax of the plan's logits rows (float32) and the copies of what is kept."""
    targets = to_device(plan.targets)
    chosen, top_lp, top_ids = [], [], []
    for start in range(0, len(logits), ROWS_PER_SLICE):
        logprobs = torch.log_softmax(logits[start:start + ROWS_PER_SLICE].float(), dim=-1)
        chosen.append(logprobs.gather(1, targets[start:start + ROWS_PER_SLICE, None]).squeeze(1))
        if plan.num_top:
            values, ids = logprobs.topk(plan.num_top, dim=-1)
            top_lp.append(values)
            top_ids.append(ids)
    to_host = lambda parts: torch.cat(parts).to("cpu", non_blocking=True)  # noqa: E731
    plan.chosen = to_host(chosen)
    if plan.num_top:
        plan.top_logprobs, plan.top_ids = to_host(top_lp), to_host(top_ids)
    if logits.is_cuda:
        plan.done = torch.cuda.Event()
        plan.done.record()


def attach_prompt_logprobs(plan: PromptLogprobRows) -> None:
    """Write a collected step's prompt logprobs into its sequences: {token id: logprob} with the
    prompt token first, then its top k alternatives."""
    if plan.done is not None:
        plan.done.synchronize()
    chosen, targets = plan.chosen.tolist(), plan.targets.tolist()
    top_lp = plan.top_logprobs.tolist() if plan.num_top else None
    top_ids = plan.top_ids.tolist() if plan.num_top else None
    row = 0
    for seq, first, count in zip(plan.seqs, plan.first_positions, plan.counts):
        k = seq.sampling_params.prompt_logprobs
        for position in range(first, first + count):
            entry = {targets[row]: chosen[row]}
            if k:
                for token_id, logprob in zip(top_ids[row][:k], top_lp[row][:k]):
                    entry.setdefault(token_id, logprob)
            seq.prompt_logprobs[position + 1] = entry
            row += 1
