"""What a pooling request asks for (runner="pooling"): its embedding, optionally truncated.

An embedding is the final (normed) hidden state of the prompt's last token, L2-normalised, as
Qwen3-Embedding's sentence-transformers config reads it. `dimensions` keeps the first d values and
normalises again (Matryoshka truncation), as OpenAI's `dimensions` and vLLM do.
"""
import math
from dataclasses import dataclass


@dataclass(slots=True)
class PoolingParams:
    dimensions: int | None = None     # keep the first d values (then renormalise); None: all

    def validate(self, hidden_size: int) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= hidden_size):
            raise ValueError(f"dimensions must be an integer in [1, {hidden_size}] (the model's hidden size) "
                             f"or None, got {d!r}")

    def apply(self, embedding: list[float]) -> list[float]:
        """The embedding as asked: truncated to `dimensions` and L2-normalised again."""
        if self.dimensions is None or self.dimensions == len(embedding):
            return embedding
        kept = embedding[:self.dimensions]
        norm = math.sqrt(sum(x * x for x in kept)) or 1.0
        return [x / norm for x in kept]
