"""What the scheduler asks of a proposer (ngram_proposer.py, draft_proposer.py)."""
from typing import Protocol

from nanovllm.core.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] guesses of seqs[i]'s next tokens (every token of seqs[i] is on the host)."""

    def reset(self) -> None:
        """Forget any state kept per sequence (the engine dropped its steps after an interruption)."""

    def close(self) -> None:
        """Free what it holds on the device."""
