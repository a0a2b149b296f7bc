"""Verify proposed tokens against the target: keep a prefix of them and sample one more, so that
every emitted token follows the target's filtered distribution p exactly.

A proposer that names its tokens outright is a point-mass draft q (one-hot at the proposal x):
x is kept with probability min(1, p(x) / q(x)) = p(x); at the first rejection the next token is
drawn from max(0, p - q) normalised, which is p without x, renormalised; when every proposal is
kept, a bonus token is drawn from p at the position after them. Together: p(x) * [x] +
(1 - p(x)) * p(y) / (1 - p(x)) = p(y) for every y. Greedy rows accept while the argmax equals the
proposal and emit the argmax after. p is the distribution the plain sampler draws from
(layers/sampler.py): min_tokens bans, temperature, min_p, top_k, top_p.

A verify step holds one row of logits per position: a sequence with k proposals has k + 1 rows
(the positions of its last token and of each proposal), rows of one sequence adjacent.
"""
from dataclasses import dataclass

import torch

from nanovllm.kernels.sampling import gumbel_argmax, gumbel_argmax_ref
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors, filter_probs


@dataclass(slots=True)
class VerifyTensors:
    """Per row of a verify step (sequence s's rows are its positions 0..k_s, adjacent)."""
    draft_token_ids: torch.Tensor   # [rows] int64: the proposal this row checks; -1 on a bonus row
    seq_of_row: torch.Tensor        # [rows] int64
    position_in_seq: torch.Tensor   # [rows] int64: 0..k_s
    uniforms: torch.Tensor          # [rows] float32 in [0, 1): the acceptance draws
    num_seqs: int


def target_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Each sampled row's filtered distribution, normalised (greedy rows: anything; unused)."""
    greedy = (sampling.temperatures == 0).unsqueeze(1)
    probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, sampling.temperatures.unsqueeze(1)), dim=-1)
    kept = filter_probs(probs, sampling.min_p, sampling.top_k, sampling.top_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def rejection_sample(logits: torch.Tensor, sampling: SamplingTensors,
                     verify: VerifyTensors) -> tuple[SamplerOutput, torch.Tensor]:
    """Row outputs (the token each row emits; only rows up to a sequence's accepted count mean
    anything) and each sequence's number of accepted proposals."""
    banned = Sampler._ban(logits, sampling)
    greedy = sampling.temperatures == 0
    drafts = verify.draft_token_ids
    has_draft = drafts >= 0
    proposal = drafts.clamp(min=0).unsqueeze(1)
    best = banned.argmax(dim=-1)
    if sampling.all_greedy:
        accepted = best == drafts
        recovered = best
    else:
        p = target_probs(banned, sampling)
        accepted = torch.where(greedy, best == drafts, verify.uniforms < p.gather(1, proposal).squeeze(1))
        # at a rejection: p without the proposal (renormalising is the sampler's business: Gumbel-max
        # over log-probabilities needs none); on a bonus row p itself
        residual = p.scatter(1, proposal, 0.0)
        # (a proposal holding all of p, rounded under 1, can lose to its draw: it is then emitted anyway)
        residual = torch.where(has_draft.unsqueeze(1) & (residual.sum(dim=-1, keepdim=True) > 0), residual, p)
        scores = torch.where(greedy.unsqueeze(1), banned.float(), residual.log())
        temperatures = (~greedy).float()
        if scores.is_cuda:
            recovered = gumbel_argmax(scores, temperatures, sampling.seeds)
        else:
            recovered = gumbel_argmax_ref(scores, temperatures, sampling.seeds.tolist())
    # a sequence keeps its proposals up to the first row that stops it (a rejection or its bonus row)
    stops = ~(accepted & has_draft)
    beyond = torch.iinfo(torch.int64).max
    first_stop = torch.where(stops, verify.position_in_seq, beyond)
    num_accepted = torch.full((verify.num_seqs,), beyond, dtype=torch.int64, device=logits.device)
    num_accepted = num_accepted.scatter_reduce(0, verify.seq_of_row, first_stop, reduce="amin")
    keeps_proposal = verify.position_in_seq < num_accepted[verify.seq_of_row]
    out = SamplerOutput(torch.where(keeps_proposal, drafts, recovered))
    if sampling.max_logprobs is not None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out.logprobs = logprobs.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
        out.top_logprobs, out.top_token_ids = logprobs.topk(sampling.max_logprobs, dim=-1)
    return out, num_accepted
