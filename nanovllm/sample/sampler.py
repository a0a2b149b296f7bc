"""Turns one row of logits per sequence into the next token, on the device that holds the logits.

Filters apply in the order temperature, min_p, top_k, top_p, each on what the previous one left.
Without filters a row is sampled straight from its logits by Gumbel-max
(kernels/sampling.py); with filters the kept probabilities are computed first and sampled the
same way. Each row's noise comes from its own seed, so a seeded request gets the same tokens
whatever else is in the batch.
"""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.kernels.sampling import gumbel_argmax, gumbel_argmax_ref
from nanovllm.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref


@dataclass(slots=True)
class SamplingTensors:
    temperatures: torch.Tensor            # [n] float32; 0 = greedy
    seeds: torch.Tensor                   # [n] int64 noise seed of each row for this step
    all_greedy: bool = False              # skip the sampling work altogether
    top_k: torch.Tensor | None = None     # [n] int64, vocab size where off; None when off for all
    top_p: torch.Tensor | None = None     # [n] float32, 1 where off
    min_p: torch.Tensor | None = None     # [n] float32, 0 where off
    banned_tokens: dict[int, list[int]] | None = None   # row -> ids not allowed yet (min_tokens)
    max_logprobs: int | None = None       # top alternatives to report; None: no logprobs asked
    # structured outputs: bit t of bitmask row i allows token t in logits row bitmask_rows[i] ([k,
    # ceil(vocab / 32)] int32 from xgrammar, [k] int32); None when no row is constrained
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor                  # [n]
    logprobs: torch.Tensor | None = None     # [n] logprob of the chosen token
    top_logprobs: torch.Tensor | None = None  # [n, k]
    top_token_ids: torch.Tensor | None = None  # [n, k]


class Sampler(nn.Module):
    @torch.no_grad()
    def forward(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        out = SamplerOutput(self._sample(self._ban(logits, params), params))
        if params.max_logprobs is not None:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            out.logprobs = logprobs.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
            out.top_logprobs, out.top_token_ids = logprobs.topk(params.max_logprobs, dim=-1)
        return out

    @staticmethod
    def _ban(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """Logits with what min_tokens and the grammars forbid at -inf, for sampling only: logprobs
        are the model's own."""
        if not params.banned_tokens and params.token_bitmask is None:
            return logits
        logits = logits.clone()
        for row, token_ids in (params.banned_tokens or {}).items():
            logits[row, token_ids] = float("-inf")
        if params.token_bitmask is not None:
            apply = apply_token_bitmask if logits.is_cuda else apply_token_bitmask_ref
            apply(logits, params.token_bitmask, params.bitmask_rows)
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        if params.all_greedy:
            return logits.argmax(dim=-1)
        scores, temperatures = logits, params.temperatures
        if params.min_p is not None or params.top_k is not None or params.top_p is not None:
            greedy = (temperatures == 0).unsqueeze(1)
            probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, temperatures.unsqueeze(1)), dim=-1)
            kept = filter_probs(probs, params.min_p, params.top_k, params.top_p)
            scores = torch.where(greedy, logits.float(), kept.log())
            temperatures = torch.where(greedy.squeeze(1), 0.0, 1.0)   # already applied to the kept probs
        if scores.is_cuda:
            return gumbel_argmax(scores, temperatures, params.seeds)
        return gumbel_argmax_ref(scores, temperatures, params.seeds.tolist())


def filter_probs(probs: torch.Tensor, min_p: torch.Tensor | None, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    """Zero the probabilities that min_p, then top_k, then top_p remove (rows need not sum to 1)."""
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
    if top_k is None and top_p is None:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if top_k is not None:
        rank = torch.arange(probs.shape[-1], device=probs.device)
        sorted_probs = sorted_probs.masked_fill(rank.unsqueeze(0) >= top_k.unsqueeze(1), 0.0)
    if top_p is not None:
        mass = sorted_probs.cumsum(dim=-1)
        mass_before = (mass - sorted_probs) / mass[:, -1:]
        # keep the smallest prefix whose mass reaches top_p, including the token that crosses it
        # (rows with top_p = 1 are exempt: float32 rounding would drop their far tail)
        sorted_probs = sorted_probs.masked_fill((mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
