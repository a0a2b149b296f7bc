"""CUDA graphs of short steps over fixed input buffers, one per batch size: decode steps (one token
per sequence) and, with speculative decoding, steps of up to `query_len` tokens per sequence over
its cached blocks (verify steps, a draft's catch-up).

A replay copies a step's inputs into those buffers with a single host-to-device copy (through pinned
host buffers used in turn, one per step that may still be queued: the copy of such a step may still
read its buffer; two, or under P pipeline stages P, as rank 0 keeps that many steps in flight), pads
the batch up to the captured size (padding rows write and read nothing), and replays.

A multi-token graph gives every sequence query_len rows: token j of sequence s sits in row
s * query_len + j, and the rows after a sequence's own tokens are padding. Padding writes no cache
slot and comes after the sequence's tokens, so causal attention hides it from them; the sequence's
context length grows by its padding so that its own tokens keep their positions.

Under pipeline stages each stage captures its own layers: a stage after the first reads the
previous stage's hidden states and residual from a fixed buffer (the worker copies what it received
into it), and a stage before the last leaves its pair in `outputs` for the worker to send. The
send and receive stay outside the graphs.
"""
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanovllm.attention import AttentionBackend, use_metadata
from nanovllm.core.step import StepInputs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, 512)
    return [b for b in (1, 2, 4, 8) if b < largest] + list(range(16, largest, 16)) + [largest]


def longest_context_first(context_lens: np.ndarray, size: int) -> np.ndarray:
    """The order in which decode attention takes a batch padded to `size` sequences: longest context
    first, so that the last wave of programs is the shortest, and the padding (which reads nothing) last."""
    return np.concatenate([np.argsort(-context_lens, kind="stable"), np.arange(len(context_lens), size)])


class StepGraphs:
    def __init__(self, model: nn.Module, backend: AttentionBackend, max_num_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, query_len: int = 1, pool=None,
                 num_stages: int = 1, first_stage: bool = True, last_stage: bool = True):
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.query_len = query_len
        # a sequence's padding rows may reach past its last block: they read block 0, write nothing
        self.width = max_blocks_per_seq + query_len - 1
        largest = self.sizes[-1]
        rows = largest * query_len
        # one int64 buffer: input ids, positions, slots, context lengths, decode order, block tables
        self.inputs = torch.zeros(rows * 3 + largest * (2 + self.width), dtype=torch.int64, device=device)
        self.inputs_host = [torch.zeros(self.inputs.shape, dtype=torch.int64).pin_memory()
                            for _ in range(max(2, num_stages))]
        self.cu_seqlens_q = torch.arange(0, rows + 1, query_len, dtype=torch.int32, device=device)
        # pipeline stages: the previous stage's (hidden states, residual) in, or this stage's out
        self.activations = None if first_stage else torch.zeros(2, rows, hidden_size, dtype=dtype, device=device)
        self.sends_on = not last_stage
        self.outputs = torch.zeros(*((2,) if self.sends_on else ()), rows, hidden_size, dtype=dtype, device=device)
        # a padding sequence of a multi-token graph attends to block 0 (reading before its first key
        # would index the block table out of bounds)
        self._padding_context_len = 0 if query_len == 1 else query_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self._capture(model, backend, device)

    @torch.inference_mode()
    def _capture(self, model: nn.Module, backend: AttentionBackend, device: torch.device) -> None:
        input_ids, positions, slot_mapping, context_lens, seq_order, block_tables = self._views(self.inputs)
        slot_mapping.fill_(-1)      # the warm-ups and uploads below write no cache slot
        context_lens.fill_(self._padding_context_len)
        seq_order.copy_(torch.arange(len(seq_order)))
        for size in reversed(self.sizes):
            rows = size * self.query_len
            metadata = (backend.decode_metadata(slot_mapping[:size], context_lens[:size], block_tables[:size],
                                                seq_order[:size])
                        if self.query_len == 1 else
                        backend.multi_token_metadata(slot_mapping[:rows], context_lens[:size], block_tables[:size],
                                                     self.cu_seqlens_q[:size + 1], self.query_len))
            with use_metadata(metadata):
                self._run(model, input_ids, positions, rows)   # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, self.pool):
                    self._run(model, input_ids, positions, rows)
            self.pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize(device)
        # A graph's first launch also uploads it to the device while the host waits: do that now,
        # not on the first step of each batch size.
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize(device)

    def _run(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, rows: int) -> None:
        if self.activations is None:
            out = model(input_ids[:rows], positions[:rows])
        else:
            out = model(input_ids[:rows], positions[:rows], (self.activations[0, :rows], self.activations[1, :rows]))
        if self.sends_on:
            self.outputs[0, :rows], self.outputs[1, :rows] = out
        else:
            self.outputs[:rows] = out

    def size_for(self, inputs: StepInputs) -> int:
        """The captured batch size that serves this step, or 0 if these graphs cannot."""
        if inputs.num_seqs > self.sizes[-1]:
            return 0
        if self.query_len == 1 and inputs.is_prefill:
            return 0
        if self.query_len > 1 and (not inputs.is_prefill or np.diff(inputs.cu_seqlens_q).max() > self.query_len):
            return 0
        return next(size for size in self.sizes if size >= inputs.num_seqs)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        largest = self.sizes[-1]
        rows = largest * self.query_len
        ids, pos, slots, lens, order, tables = flat.split([rows] * 3 + [largest, largest, largest * self.width])
        return [ids, pos, slots, lens, order, tables.view(largest, self.width)]

    def replay(self, inputs: StepInputs, size: int, read_pending_tokens: Callable[[torch.Tensor], torch.Tensor] | None,
               activations: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], np.ndarray]:
        """Run the step; its hidden states (on a stage before the last, the pair to send on) and the
        rows of those to sample. `activations`: the previous stage's, on a stage after the first (which
        embeds no ids: `read_pending_tokens` is None there)."""
        n, width = inputs.num_seqs, self.query_len
        host = self.inputs_host.pop(0)
        self.inputs_host.append(host)
        input_ids, positions, slot_mapping, context_lens, seq_order, block_tables = self._views(host)
        if width == 1:
            token_rows, lens, sampled = slice(0, n), inputs.context_lens, inputs.logits_indices
            seq_order[:size] = torch.from_numpy(longest_context_first(lens, size))
        else:              # each sequence's tokens to its own rows
            q_lens = np.diff(inputs.cu_seqlens_q)
            shift = np.repeat(np.arange(n) * width - inputs.cu_seqlens_q[:-1], q_lens)
            rows = np.arange(len(inputs.input_ids)) + shift
            token_rows, lens, sampled = torch.from_numpy(rows), inputs.context_lens + width - q_lens, \
                rows[inputs.logits_indices]
        input_ids[:size * width] = 0
        input_ids[token_rows] = torch.from_numpy(inputs.input_ids)
        positions[token_rows] = torch.from_numpy(inputs.positions)
        slot_mapping[:size * width] = -1              # padding rows write nothing ...
        slot_mapping[token_rows] = torch.from_numpy(inputs.slot_mapping)
        context_lens[:n] = torch.from_numpy(lens)
        context_lens[n:size] = self._padding_context_len   # ... and read nothing, or block 0
        block_tables[:n, :inputs.block_tables.shape[1]] = torch.from_numpy(inputs.block_tables)
        self.inputs.copy_(host, non_blocking=True)
        if read_pending_tokens is not None and inputs.input_ids.min() < 0:
            ids = self.inputs[:n * width]             # the input-id view comes first
            ids.copy_(read_pending_tokens(ids))
        if activations is not None:
            self.activations[0, :n * width], self.activations[1, :n * width] = activations
        self.graphs[size].replay()
        if self.sends_on:
            return (self.outputs[0, :n * width], self.outputs[1, :n * width]), sampled
        return self.outputs[:n * width], sampled
