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

    def pending(self, completion_ids: list[int]) -> list[list[int]]:
        """The id lists update must decode (the context, then the context and the new tokens), so a
        caller can decode those of many sequences in one batch; none when nothing is new."""
        if len(completion_ids) == self.read_offset:
            return []
        return [completion_ids[self.prefix_offset:self.read_offset], completion_ids[self.prefix_offset:]]

    def update(self, completion_ids: list[int], find_stop: bool = True, final: bool = False,
               decoded: list[str] | None = None) -> None:
        """Decode the tokens not seen yet (or take `decoded`, the texts of `pending`); look for a stop
        string in the new text if find_stop. With final, a character still missing bytes is taken as it decodes."""
        if len(completion_ids) == self.read_offset:
            return
        context, window = decoded or decode_many(self.tokenizer, self.pending(completion_ids))
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


def decode_many(tokenizer: PreTrainedTokenizerBase, id_lists: list[list[int]]) -> list[str]:
    """tokenizer.decode of each list (special tokens skipped). A fast tokenizer decodes them all in
    one call to its Rust backend, which costs a step of 256 streams about a tenth of one call each."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not tokenizer.clean_up_tokenization_spaces:
        return backend.decode_batch(id_lists, skip_special_tokens=True)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in id_lists]
