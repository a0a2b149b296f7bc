"""Incremental detokenization: the text of a growing completion, a few tokens at a time.

Each update decodes only a short window (the tokens decoded last time, for context, plus the new
ones), so the work per step follows the new tokens, not the length of the completion. Two kinds of
text are held back from the deltas it hands out: a character whose bytes have not all arrived yet
(it decodes as U+FFFD), and a tail that could still grow into a stop string. A stop string found in
the text cuts it there; the text never shows it.
"""
from transformers import PreTrainedTokenizerBase

INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max(map(len, stop), default=0)
        self.text = ""                 # every complete character decoded so far
        self.stop_at: int | None = None  # where the first stop string found in text begins
        self.prefix_offset = 0         # completion tokens [prefix_offset, read_offset) were decoded
        self.read_offset = 0           # last time; they give the new tokens their context
        self.num_text_sent = 0         # characters of text already handed out as deltas
        self.num_tokens_sent = 0       # completion tokens already reported
        self.finished_sent = False     # the sequence's end has been reported

    def update(self, completion_ids: list[int], find_stop: bool = True, final: bool = False) -> None:
        """Decode the tokens not seen yet; look for a stop string in the new text if find_stop.
        With final, a character still missing bytes is taken as it decodes."""
        if len(completion_ids) == self.read_offset:
            return
        decode = self._decode
        context = decode(completion_ids[self.prefix_offset:self.read_offset])
        window = decode(completion_ids[self.prefix_offset:])
        if window.endswith(INCOMPLETE) and not final:
            return                     # wait for the rest of the character's bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(completion_ids)
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += window[len(context):]
        if find_stop and self.stop and self.stop_at is None:
            found = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if found:
                self.stop_at = min(found)

    @property
    def visible_text(self) -> str:
        return self.text if self.stop_at is None else self.text[:self.stop_at]

    def delta(self, final: bool = False) -> str:
        """Text not handed out yet; unless final, without a tail that could begin a stop string."""
        end = len(self.visible_text)
        if not final and self.stop_at is None:
            end -= self._stop_prefix_len()
        if end <= self.num_text_sent:
            return ""
        delta, self.num_text_sent = self.text[self.num_text_sent:end], end
        return delta

    def new_token_ids(self, completion_ids: list[int]) -> list[int]:
        new, self.num_tokens_sent = completion_ids[self.num_tokens_sent:], len(completion_ids)
        return new

    def _stop_prefix_len(self) -> int:
        """Length of the longest end of text that is the start of a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
