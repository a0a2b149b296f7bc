"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its prompt and output so far.
No model runs; repetitive text (code edits, quoting the prompt, lists) is guessed well.

When fewer than k tokens follow the match, the copy goes on over its own proposals: a match p
tokens back says the text repeats with period p, so a run of one token proposes k more of it."""
import numpy as np

from nanovllm.core.sequence import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [self.propose_tokens(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def reset(self) -> None:
        """Nothing to forget: proposals come from the tokens alone."""

    def close(self) -> None:
        pass

    def propose_tokens(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix that has one."""
        num_tokens = len(token_ids)
        if k < 1 or num_tokens < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)   # starts 0 .. num_tokens-1-n
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n          # the token after the latest match
                period = num_tokens - start
                return [token_ids[start + j % period] for j in range(k)]
        return []
