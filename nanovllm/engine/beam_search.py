"""One prompt's beam search over forked sequences, with vLLM's algorithm.

Each step, every live beam proposes its 2 * beam_width most likely next tokens (the model's
log-softmax at temperature 1, in descending order). A candidate ending in EOS (unless ignore_eos)
joins the finished list; the best beam_width of the others by cumulative logprob live on. After
max_tokens steps the live beams join the finished list, which is ranked by
cum_logprob / L ** length_penalty (L = prompt plus generated tokens, less one for a final EOS).

The engine runs the beams as sequences: a beam continued by several candidates is forked (its
blocks shared, copied on write), a beam continued by none is dropped. Choosing needs every live
beam's candidates, so a beam that has proposed waits (computes nothing) until its siblings have.
"""
from dataclasses import dataclass

from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import BeamSearchParams


@dataclass(slots=True)
class Continuation:
    beam: Sequence        # the live beam it extends
    token_id: int
    cum_logprob: float


@dataclass(slots=True)
class FinishedBeam:
    token_ids: list[int]  # generated only
    cum_logprob: float
    finish_reason: str


class BeamSearch:
    def __init__(self, params: BeamSearchParams, root: Sequence, eos_token_ids: tuple[int, ...], max_tokens: int):
        self.params = params
        self.request_id = root.request_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ending_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.max_tokens = max_tokens
        self.num_prompt_tokens = root.num_prompt_tokens
        self.live: list[Sequence] = [root]
        self.finished: list[FinishedBeam] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.live

    def ready(self) -> bool:
        """Every live beam has proposed its candidates for this step."""
        return bool(self.live) and all(beam.beam_candidates is not None for beam in self.live)

    def choose(self) -> list[Continuation]:
        """This step's choice: the continuations that live on (best first); EOS endings, and at the
        last step every continuation, go to the finished list."""
        width = self.params.beam_width
        continuations = []
        for beam in self.live:
            for token_id, logprob in list(beam.beam_candidates.items())[:2 * width]:
                cum_logprob = beam.cum_logprob + logprob
                if token_id in self.ending_token_ids:
                    self.finished.append(FinishedBeam(beam.completion_token_ids + [token_id], cum_logprob, "stop"))
                else:
                    continuations.append(Continuation(beam, token_id, cum_logprob))
        continuations = sorted(continuations, key=lambda c: c.cum_logprob, reverse=True)[:width]
        self.num_steps += 1
        if self.num_steps >= self.max_tokens:
            self.finished += [FinishedBeam(c.beam.completion_token_ids + [c.token_id], c.cum_logprob, "length")
                              for c in continuations]
            return []
        return continuations

    def score(self, beam: FinishedBeam) -> float:
        length = self.num_prompt_tokens + len(beam.token_ids)
        if beam.token_ids and beam.token_ids[-1] in self.eos_token_ids:
            length -= 1
        return beam.cum_logprob / length ** self.params.length_penalty

    def best(self) -> list[FinishedBeam]:
        return sorted(self.finished, key=self.score, reverse=True)[:self.params.beam_width]
