"""What the attention layers need to know about the current step, set once per forward."""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionContext:
    is_prefill: bool
    slot_mapping: torch.Tensor        # [num_tokens] cache slot of each new token; -1 = padding
    context_lens: torch.Tensor        # [num_seqs] keys each sequence attends to (cached + new)
    block_tables: torch.Tensor        # [num_seqs, max_blocks] physical block of each logical block
    cu_seqlens_q: torch.Tensor | None = None   # [num_seqs + 1] prefill: where each sequence's tokens start
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0
    has_cached_context: bool = False  # prefill: some sequence attends to keys from earlier steps
    num_splits: int = 1               # decode: context splits per sequence (see paged attention)


_context: AttentionContext | None = None


def set_context(context: AttentionContext | None) -> None:
    global _context
    _context = context


def get_context() -> AttentionContext:
    assert _context is not None, "attention called outside a model runner step"
    return _context
