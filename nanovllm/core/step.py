"""Step data: what the scheduler decided for one step (ScheduledBatch), and the same step as flat
host arrays for the model (StepInputs). The scheduler and the engine core build these; executors
ship StepInputs to the workers. Nothing here touches a tensor.
"""
from dataclasses import dataclass, field

import numpy as np

from nanovllm.core.sequence import Sequence

# Speculation steps aside above this many running sequences: a large decode batch is no longer
# bound by reading the weights, so verifying proposals stops being free, and a speculating engine
# collects every step before the next (no overlap). Measured on one H100 (docs/benchmarks.md): an
# eager verify step costs 2.3-2.5x a decode step from batch 4 to 64, and with 32 bench.py lost 6%.
SPECULATION_MAX_RUNNING = 8


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]   # tokens each sequence computes this step
    is_prefill: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # (source, destination) before it
    draft_token_ids: list[list[int]] | None = None   # decode: each sequence's proposals to verify
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)    # (GPU block, host block) before it
    kv_loads: list[tuple[int, int]] = field(default_factory=list)       # (host block, GPU block) before it

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def sampled_seqs(self) -> list[Sequence]:
        """The sequences that get a token from this step: those it brings to their last token.
        (Ask before Scheduler.advance records the step.)"""
        if not self.is_prefill:
            return self.seqs
        return [seq for seq, n in zip(self.seqs, self.num_new_tokens) if seq.num_computed_tokens + n == seq.num_tokens]


@dataclass(slots=True)
class ShardSampling:
    """A step whose rows are all greedy or plain temperature sampling: under tensor parallelism each
    rank samples its own vocabulary shard (sample/shard_sampler.py) instead of gathering the logits."""
    temperatures: np.ndarray    # [rows] float32; 0 = greedy
    seeds: np.ndarray           # [rows] int64 noise seed of each row for this step

    @property
    def all_greedy(self) -> bool:
        return not self.temperatures.any()


@dataclass(slots=True)
class StepInputs:
    """Everything the model needs for one step, as flat host arrays (cheap to ship to TP workers)."""
    is_prefill: bool
    input_ids: np.ndarray       # [num_tokens]; a negative id is a pending token (pending_token_marker)
    positions: np.ndarray       # [num_tokens]
    slot_mapping: np.ndarray    # [num_tokens] cache slot of each token
    context_lens: np.ndarray    # [num_seqs] cached + new tokens
    cu_seqlens_q: np.ndarray    # [num_seqs + 1] where each sequence's new tokens start
    block_tables: np.ndarray    # [num_seqs, max_blocks], padded with 0
    logits_indices: np.ndarray  # rows whose next token is sampled (last token of a finished prompt)
    block_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # [n, 2] src, dst
    # the prefix cache's host tier, made before the step: [n, 2] (GPU, host) and (host, GPU) blocks
    kv_offloads: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    kv_loads: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    # tensor parallelism on one stage: how every rank gets the sampled ids (the next step may read
    # them as pending tokens); rank 0 decides, the other ranks follow (Worker.run)
    shard_sampling: ShardSampling | None = None   # every rank samples its shard of the vocabulary
    num_shared_tokens: int = 0    # or rank 0 samples the gathered logits and broadcasts this many ids

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def pending_token_marker(row: int) -> int:
    """The input id that stands for a token still on the device: row `row` of the sampled ids it
    keeps (the last sampler output; under pipeline stages, rows for each step in flight)."""
    return -1 - row


def pending_slot_offsets(input_ids: np.ndarray, slot_rows: int) -> list[int]:
    """Under pipeline stages, where the slots (of `slot_rows` rows, one per step in flight) start
    whose sampled ids a step's pending tokens read."""
    rows = -1 - input_ids[input_ids < 0]
    return [int(slot) * slot_rows for slot in np.unique(rows // slot_rows)]
