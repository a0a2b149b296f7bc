"""Verify proposed tokens against the target: keep a prefix of them and one more token, so that
every emitted token follows the target's filtered distribution p exactly.

A proposer that names its tokens outright (n-gram lookup, a greedy draft) is a point-mass draft q,
one-hot at its proposal x. Rejection sampling then keeps x with probability min(1, p(x) / q(x)) =
p(x), and at the first rejection draws from max(0, p - q) normalised: p without x, renormalised;
when every proposal is kept, a bonus token is drawn from p at the position after them.

We draw the same thing by sampling each position from p exactly as the plain sampler would
(sample/sampler.py: min_tokens bans, temperature, min_p, top_k, top_p; the same per-position seeds)
and keeping x while the sample equals it: the sample is x with probability p(x), and otherwise it
is distributed as p without x, renormalised, and is the token emitted in x's place. Greedy rows keep
x while the argmax equals it. Because the noise at each position is the plain sampler's, a seeded
request emits the same tokens with speculation as without it, whatever the proposals were.

A verify step holds one row of logits per position: a sequence with k proposals has k + 1 rows
(the positions of its last token and of each proposal), rows of one sequence adjacent.
"""
from dataclasses import dataclass

import torch

from nanovllm.sample.sampler import Sampler, SamplerOutput, SamplingTensors


@dataclass(slots=True)
class VerifyTensors:
    """Per row of a verify step (sequence s's rows are its positions 0..k_s, adjacent)."""
    draft_token_ids: torch.Tensor   # [rows] int64: the proposal this row checks; -1 on a bonus row
    seq_of_row: torch.Tensor        # [rows] int64
    position_in_seq: torch.Tensor   # [rows] int64: 0..k_s
    num_seqs: int


def rejection_sample(logits: torch.Tensor, sampling: SamplingTensors,
                     verify: VerifyTensors) -> tuple[SamplerOutput, torch.Tensor]:
    """Row outputs (the token each row emits, with its logprobs; only rows up to a sequence's
    accepted count mean anything) and each sequence's number of accepted proposals."""
    out = Sampler()(logits, sampling)
    # a sequence keeps its proposals up to the first row that stops it (a mismatch or its bonus row)
    stops = out.token_ids != verify.draft_token_ids
    beyond = torch.iinfo(torch.int64).max
    first_stop = torch.where(stops, verify.position_in_seq, beyond)
    num_accepted = torch.full((verify.num_seqs,), beyond, dtype=torch.int64, device=logits.device)
    return out, num_accepted.scatter_reduce(0, verify.seq_of_row, first_stop, reduce="amin")
