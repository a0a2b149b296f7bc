"""Response bodies and stream chunks in OpenAI's schema, built from engine outputs."""
import json
import time
import uuid

from nanovllm.serve.chat_output import ChatOutputParsing


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class ResponseBuilder:
    """Builds the bodies of one response: completion or chat, whole or as chunks."""

    def __init__(self, chat: bool, model: str, tokenizer, num_top_logprobs: int | None,
                 parsing: ChatOutputParsing | None = None):
        self.chat = chat
        self.parsing = parsing or ChatOutputParsing()   # chat: how text becomes content, reasoning, tool calls
        self.choice_parsers = {}                        # chat streams: each choice's parser
        self.model = model
        self.tokenizer = tokenizer
        self.num_top_logprobs = num_top_logprobs     # None: no logprobs asked
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.text_offset = {}                       # completions: per choice, where the next token starts

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # ---- whole responses -------------------------------------------------------------------------

    def response(self, finals: list[dict], prompt_tokens: int) -> dict:
        choices = []
        for index, out in enumerate(finals):
            logprobs = self.logprobs(index, out["token_ids"], out.get("logprobs"))
            if self.chat:
                parser = self.parsing.new_choice()
                choices.append({"index": index, "message": parser.message(out["text"]), "logprobs": logprobs,
                                "finish_reason": parser.finish_reason(out["finish_reason"])})
            else:
                choices.append({"index": index, "text": out["text"], "logprobs": logprobs,
                                "finish_reason": out["finish_reason"]})
        completion_tokens = sum(len(out["token_ids"]) for out in finals)
        return {**self._envelope(chunk=False), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    # ---- stream chunks ---------------------------------------------------------------------------

    def role_chunk(self, index: int) -> dict:
        """Chat streams open each choice with the assistant role."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, index: int, out: dict, token_ids: list[int], logprobs: list[dict] | None) -> dict | None:
        """This output's new text; the logprobs are those of token_ids (its new tokens). The choice's
        finish_reason comes with the output that ends it. None: nothing to send yet (chat text
        that the parsers hold back until they know what it is)."""
        finish_reason = out["finish_reason"]
        logprobs = self.logprobs(index, token_ids, logprobs)
        if self.chat:
            if index not in self.choice_parsers:
                self.choice_parsers[index] = self.parsing.new_choice()
            parser = self.choice_parsers[index]
            delta = parser.feed(out["delta_text"])
            if finish_reason is not None:
                delta = merge_deltas(delta, parser.finish())
                finish_reason = parser.finish_reason(finish_reason)
            elif not delta and not logprobs:
                return None
            elif not delta:
                delta = {"content": ""}
            return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        return self._chunk({"index": index, "text": out["delta_text"], "logprobs": logprobs,
                            "finish_reason": finish_reason})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self._envelope(chunk=True), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def _chunk(self, choice: dict) -> dict:
        return {**self._envelope(chunk=True), "choices": [choice]}

    # ---- logprobs --------------------------------------------------------------------------------

    def logprobs(self, index: int, token_ids: list[int], logprobs: list[dict] | None) -> dict | None:
        """The logprobs of these tokens in the API's shape; logprobs[i] maps token id -> logprob for
        token i's chosen token and its top alternatives."""
        if self.num_top_logprobs is None or logprobs is None:
            return None
        entries = []
        for token_id, candidates in zip(token_ids, logprobs):
            if candidates is None:      # echo: the prompt's first token has no logprob
                entries.append((self._token(token_id), None, None))
                continue
            candidates = {int(k): float(v) for k, v in candidates.items()}
            top = sorted(candidates.items(), key=lambda kv: kv[1], reverse=True)[:self.num_top_logprobs]
            entries.append((self._token(token_id), candidates[token_id], [(self._token(t), lp) for t, lp in top]))
        if self.chat:
            return {"content": [{"token": token, "logprob": lp, "bytes": list(token.encode()),
                                 "top_logprobs": [{"token": t, "logprob": l, "bytes": list(t.encode())} for t, l in top]}
                                for token, lp, top in entries]}
        offsets = []
        offset = self.text_offset.get(index, 0)
        for token, _, _ in entries:
            offsets.append(offset)
            offset += len(token)
        self.text_offset[index] = offset
        return {"tokens": [token for token, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else _first_per_key(top) for _, _, top in entries],
                "text_offset": offsets}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def merge_deltas(first: dict, second: dict) -> dict:
    """One delta with both deltas' text and tool-call pieces."""
    merged = dict(first)
    for key, value in second.items():
        merged[key] = merged.get(key, "" if isinstance(value, str) else []) + value
    return merged


def _first_per_key(pairs: list[tuple[str, float]]) -> dict[str, float]:
    """Completions key alternatives by token text; two tokens may decode alike (partial characters):
    keep the likelier."""
    top = {}
    for token, logprob in pairs:
        top.setdefault(token, logprob)
    return top
