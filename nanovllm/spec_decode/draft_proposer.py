"""Proposals from a smaller draft model of the same vocabulary, run greedily by a second Executor
over its own paged KV cache.

The draft keeps one shadow sequence per target sequence, in its own block manager. Its KV lags the
target: proposals the target rejected left stale entries behind, so each pass first finds how many
of the shadow's computed tokens still agree with the sequence, recomputes from there (the accepted
tokens and the target's new one, in one prefill step that samples the first proposal), then decodes
the other k - 1 proposals one step each, all sequences together.

Greedy proposals are point masses (q = one-hot), which is what the rejection sampler assumes.
The draft's pool holds SPECULATION_MAX_RUNNING sequences of max_model_len (speculation steps aside
above that many); it is allocated before the target sizes its own pool from what is left.
"""
import numpy as np

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.step import SPECULATION_MAX_RUNNING, ScheduledBatch
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams
from nanovllm.executor.executor import Executor

GREEDY = SamplingParams(temperature=0, max_tokens=1)


class DraftProposer:
    def __init__(self, config):
        """config: the target engine's Config (config.py), whose draft_config the draft runs under."""
        self.config = config.draft_config(min(config.max_num_seqs, SPECULATION_MAX_RUNNING))
        # a catch-up step computes the target's new token, and the last proposal when every one was
        # accepted: two tokens a sequence, replayed from CUDA graphs like the draft's decode steps
        self.executor = Executor(self.config, multi_token_len=2)
        self.block_manager = BlockManager(self.executor.num_kvcache_blocks, self.config.kvcache_block_size, False)
        self.shadows: dict[int, tuple[Sequence, Sequence]] = {}   # seq_id -> (sequence, its shadow)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        self.free_gone()
        bm = self.block_manager
        shadows, wanted, proposals = [], [], [[] for _ in seqs]
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            shadow = self._shadow(seq)
            if bm.can_allocate(shadow, seq.num_tokens + k - 1):   # positions up to the (k-1)th proposal's
                bm.allocate(shadow, seq.num_tokens + k - 1)
                shadows.append((i, shadow))
                wanted.append(k)
        if not shadows:
            return proposals
        self._catch_up([shadow for _, shadow in shadows])
        for (i, shadow), k in zip(shadows, wanted):
            proposals[i].append(shadow.token_ids[-1])
        while True:
            active = [(i, shadow) for (i, shadow), k in zip(shadows, wanted) if len(proposals[i]) < k]
            if not active:
                return proposals
            self._run([shadow for _, shadow in active], [1] * len(active), is_prefill=False)
            for i, shadow in active:
                proposals[i].append(shadow.token_ids[-1])

    def _shadow(self, seq: Sequence) -> Sequence:
        """seq's shadow, its computed tokens cut back to those that still agree with seq."""
        _, shadow = self.shadows.get(seq.seq_id, (seq, None))
        if shadow is None:
            shadow = Sequence(seq.token_ids, GREEDY)
            self.shadows[seq.seq_id] = (seq, shadow)
        computed = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        mismatch = np.flatnonzero(np.asarray(shadow.token_ids[:computed]) != np.asarray(seq.token_ids[:computed]))
        shadow.num_computed_tokens = int(mismatch[0]) if len(mismatch) else computed
        shadow.token_ids = list(seq.token_ids)
        return shadow

    def _catch_up(self, shadows: list[Sequence]) -> None:
        """Compute every shadow's uncomputed tokens, in steps of at most max_num_batched_tokens;
        each samples its first proposal at its last token."""
        behind = list(shadows)
        while behind:
            budget, batch, sizes = self.config.max_num_batched_tokens, [], []
            for shadow in behind:
                n = min(shadow.num_uncomputed_tokens, budget)
                if n > 0:
                    batch.append(shadow)
                    sizes.append(n)
                    budget -= n
            sampled = self._run(batch, sizes, is_prefill=True)
            behind = [shadow for shadow in behind if not any(shadow is s for s in sampled)]

    def _run(self, shadows: list[Sequence], sizes: list[int], is_prefill: bool) -> list[Sequence]:
        """One draft step; each shadow the step brings to its end gets the token sampled there
        (returns those)."""
        batch = ScheduledBatch(shadows, sizes, is_prefill)
        sampled = batch.sampled_seqs()
        token_ids, _ = self.executor.collect(self.executor.launch(batch))
        for shadow, n in zip(shadows, sizes):
            shadow.num_computed_tokens += n
        for shadow, token_id in zip(sampled, token_ids):
            shadow.token_ids.append(token_id)
        return sampled

    def free_gone(self) -> None:
        """Free the shadows of sequences that finished, were aborted or were preempted (they start
        over); the engine core calls it after every step it collects and every abort."""
        for seq_id, (seq, shadow) in list(self.shadows.items()):
            if seq.is_finished or seq.status == SequenceStatus.WAITING:
                self.block_manager.free(shadow)
                del self.shadows[seq_id]

    def reset(self) -> None:
        """Forget every shadow (the engine dropped its steps after an interruption)."""
        self.shadows.clear()
        self.block_manager.reset()

    def close(self) -> None:
        self.executor.close()
