"""Sequences to what callers read: text (detokenized incrementally), stop strings, stream updates, and
the output dict of a finished request, built here and nowhere else.

The engine core asks `finds_stop` after each token of a sequence with stop strings; streaming
consumers get a RequestUpdate per advanced sequence (`updates`), whose text deltas never split a
character and never show part of a stop string; a finished request's output is `build_output`.
"""
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.core.sequence import Sequence
from nanovllm.engine.detokenizer import IncrementalDetokenizer, decode_many


@dataclass(slots=True)
class RequestUpdate:
    """How one request advanced in a step, for streaming consumers."""
    request_id: Hashable
    index: int                    # completion index within the request
    new_token_ids: list[int]      # generated in this step
    new_logprobs: list[dict[int, float]] | None   # theirs, when the request asked for logprobs
    delta_text: str               # never splits a character, never shows part of a stop string
    text: str                     # everything so far
    token_ids: list[int]          # every generated id so far
    finished: bool
    finish_reason: str | None
    output: dict | None           # the request's final output, once it finished
    weight_version: int = 0       # of the weights that computed this step (docs/rollout.md)

    def stream_dict(self) -> dict:
        """What AsyncLLM yields for this update: the delta, and once finished the whole output with
        the top-level fields of this update's completion."""
        out = dict(self.output) if self.output is not None else {}
        out.update(request_id=self.request_id, index=self.index, weight_version=self.weight_version,
                   delta_text=self.delta_text,
                   delta_token_ids=self.new_token_ids, delta_logprobs=self.new_logprobs,
                   finished=self.output is not None, finish_reason=self.finish_reason)
        if self.output is not None and "outputs" in self.output:     # (a pooling output has no completions)
            completion = self.output["outputs"][self.index]
            out.update(text=completion["text"], token_ids=completion["token_ids"], logprobs=completion["logprobs"])
        return out


def aborted_stream_dict(request_id: Hashable, index: int) -> dict:
    """The last stream item of a request aborted before it finished."""
    return {"request_id": request_id, "index": index, "delta_text": "", "delta_token_ids": [],
            "delta_logprobs": None, "finished": True, "finish_reason": "abort"}


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        # made when text is needed before a sequence ends (stop strings, streaming); by (request, index)
        self.detokenizers: dict[tuple[Hashable, int], IncrementalDetokenizer] = {}
        self.weight_version = 0     # the engine's (engine/rollout.py), stamped on every output

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        key = (seq.request_id, seq.index)
        detokenizer = self.detokenizers.get(key)
        if detokenizer is None:
            detokenizer = self.detokenizers[key] = IncrementalDetokenizer(self.tokenizer, seq.sampling_params.stop)
        return detokenizer

    def forget(self, first: Sequence) -> None:
        for seq in first.group:
            self.detokenizers.pop((seq.request_id, seq.index), None)

    def finds_stop(self, seq: Sequence) -> bool:
        """Has seq's text (past min_tokens) reached one of its stop strings? The text stops before it."""
        detokenizer = self._detokenizer(seq)
        detokenizer.update(seq.completion_token_ids, find_stop=seq.num_completion_tokens >= seq.sampling_params.min_tokens,
                           final=seq.is_finished)
        return detokenizer.stop_at is not None

    def updates(self, seqs: list[Sequence], due: Callable[[Hashable], bool] | None) -> list[RequestUpdate]:
        """One update per sequence that has something to report (all of a step's texts decoded in one
        batch). With `due`, a request for which it is False reports only a completion's end."""
        reporting = []
        for seq in seqs:
            detokenizer = self._detokenizer(seq)
            if not detokenizer.finished_sent and (due is None or seq.is_finished or due(seq.request_id)):
                completion = seq.completion_token_ids
                reporting.append((seq, detokenizer, completion, detokenizer.pending(completion)))
        texts = iter(decode_many(self.tokenizer, [ids for *_, pending in reporting for ids in pending]))
        updates = []
        for seq, detokenizer, completion, pending in reporting:
            detokenizer.update(completion, find_stop=False, final=seq.is_finished,   # stops: see finds_stop
                               decoded=[next(texts) for _ in pending])
            detokenizer.finished_sent = seq.is_finished
            new_logprobs = None if seq.logprobs is None else seq.logprobs[detokenizer.num_tokens_sent:]
            updates.append(RequestUpdate(
                seq.request_id, seq.index, detokenizer.new_token_ids(completion), new_logprobs,
                detokenizer.delta(final=seq.is_finished), detokenizer.visible_text, completion, seq.is_finished,
                seq.finish_reason, None, self.weight_version))
        return updates

    def build_output(self, first: Sequence) -> dict:
        """A finished request's output: its completions (or, for a beam search, its best beams)."""
        now = time.perf_counter()
        output = {"request_id": first.request_id, "prompt_token_ids": first.token_ids[:first.num_prompt_tokens],
                  "num_cached_tokens": first.num_cached_tokens, "prompt_logprobs": first.prompt_logprobs,
                  "weight_version": self.weight_version}
        if first.pooling_params is not None:
            return {**output, "embedding": first.pooling_params.apply(first.embedding),
                    "finish_reason": first.finish_reason}
        if first.beam_search is not None:
            output["sequences"] = [{"token_ids": beam.token_ids, "text": self.decode(beam.token_ids),
                                    "cum_logprob": beam.cum_logprob, "finish_reason": beam.finish_reason}
                                   for beam in first.beam_search.best()]
            return output
        completions = []
        for seq in sorted(first.group, key=lambda seq: seq.index):
            seq.finish_time = seq.finish_time or now
            detokenizer = self.detokenizers.get((seq.request_id, seq.index))
            if detokenizer is not None:
                detokenizer.update(seq.completion_token_ids, find_stop=False, final=True)
                text = detokenizer.visible_text
            else:
                text = self.decode(seq.completion_token_ids)
            completions.append({"index": seq.index, "text": text, "token_ids": seq.completion_token_ids,
                                "finish_reason": seq.finish_reason, "logprobs": seq.logprobs})
        first_token = min((seq.first_token_time for seq in first.group if seq.first_token_time), default=now)
        finish = max(seq.finish_time for seq in first.group)
        num_out = first.num_completion_tokens
        return {
            **output,
            **{key: completions[0][key] for key in ("text", "token_ids", "finish_reason", "logprobs")},
            "outputs": completions,
            "metrics": {
                "time_to_first_token": first_token - first.arrival_time,
                "time_per_output_token": (first.finish_time - first_token) / (num_out - 1) if num_out > 1 else 0.0,
                "latency": finish - first.arrival_time,
            },
        }

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
