"""The attention backend interface, and the metadata of the step the model is computing.

A backend builds its own metadata from a step's inputs (what it needs beyond the common fields is
its business), the model runner holds it current while the model runs (`use_metadata`), and every
attention layer reads it through `current_metadata`. Outside a step there is none, and asking for
it fails loudly instead of reading a stale step.
"""
import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.kernels.rotary_embedding import KVStore, RotaryInputs


@dataclass(slots=True)
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor        # [num_tokens] cache slot of each new token; -1 = padding
    context_lens: torch.Tensor        # [num_seqs] keys each sequence attends to (cached + new)
    block_tables: torch.Tensor        # [num_seqs, max_blocks] physical block of each logical block
    cu_seqlens_q: torch.Tensor | None = None   # [num_seqs + 1] prefill: where each sequence's tokens start
    max_seqlen_q: int = 1
    has_cached_context: bool = False  # prefill: some sequence attends to keys from earlier steps


class AttentionBackend:
    def metadata(self, is_prefill: bool, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, host_context_lens: np.ndarray,
                 host_cu_seqlens_q: np.ndarray) -> AttentionMetadata:
        """A step's metadata from its device tensors (and host copies, for sizes without a sync)."""
        q_lens = np.diff(host_cu_seqlens_q)
        return AttentionMetadata(is_prefill, slot_mapping, context_lens, block_tables, cu_seqlens_q.int(),
                                 int(q_lens.max()), bool((host_context_lens > q_lens).any()))

    def decode_metadata(self, slot_mapping: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                        seq_order: torch.Tensor | None = None) -> AttentionMetadata:
        """Decode metadata over fixed buffers, for capturing a CUDA graph of this batch size.
        seq_order: the sequences, longest context first (a backend may schedule its work by it)."""
        return AttentionMetadata(False, slot_mapping, context_lens, block_tables)

    def multi_token_metadata(self, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             query_len: int) -> AttentionMetadata:
        """Metadata of query_len tokens per sequence over its cached blocks, on fixed buffers (a
        CUDA graph of verify steps): the paged prefill path, whatever the context."""
        return AttentionMetadata(True, slot_mapping, context_lens, block_tables, cu_seqlens_q, query_len, True)

    def rotate_and_attend(self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryInputs, kv_store: KVStore,
                          metadata: AttentionMetadata, scale: float) -> torch.Tensor | None:
        """The rotary kernel's work (q/k norm, rotary, the K/V store) and attention in one kernel, for
        the steps where a backend has one; None otherwise (the layer then rotates, then calls forward).
        q and k are as the projection left them."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q: [tokens, heads, head_dim]; k/v: this step's keys and values, already in the cache.
        A float8 cache comes with its scales (float32, one per layer or per KV head)."""
        raise NotImplementedError


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def use_metadata(metadata: AttentionMetadata):
    global _current
    _current = metadata
    try:
        yield metadata
    finally:
        _current = None


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention ran outside a model runner step (no step metadata is set)")
    return _current
