"""Pooling (runner="pooling"): the worker returns the final, normed hidden state of each prompt's
last token (the step's logits rows); an embedding is that state L2-normalised, as
Qwen3-Embedding's sentence-transformers config says (last-token pooling, then Normalize).
"""
import torch
import torch.nn.functional as F


def pool_embeddings(last_hidden: torch.Tensor) -> torch.Tensor:
    """[sequences, hidden_size] final hidden states -> unit-length float32 embeddings."""
    return F.normalize(last_hidden.float(), dim=-1)
