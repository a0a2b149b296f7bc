"""CUDA graphs of the decode step, one per batch size, over fixed input buffers.

A replay copies a step's inputs into those buffers with a single host-to-device copy (through two
pinned host buffers used in turn, since the copy of the step still queued may read the other), pads
the batch up to the captured size (padding rows write and read nothing), and replays.
"""
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention import AttentionBackend, use_metadata
from nanovllm.worker.step_inputs import StepInputs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, 512)
    return [b for b in (1, 2, 4, 8) if b < largest] + list(range(16, largest, 16)) + [largest]


class DecodeGraphs:
    def __init__(self, model: nn.Module, backend: AttentionBackend, max_num_seqs: int, max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.width = max_blocks_per_seq
        largest = self.sizes[-1]
        # one int64 buffer: input ids, positions, slots, context lengths, block tables
        self.inputs = torch.zeros(largest * (4 + self.width), dtype=torch.int64, device=device)
        self.inputs_host = [torch.zeros(self.inputs.shape, dtype=torch.int64).pin_memory() for _ in range(2)]
        self.outputs = torch.zeros(largest, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture(model, backend, device)

    @torch.inference_mode()
    def _capture(self, model: nn.Module, backend: AttentionBackend, device: torch.device) -> None:
        input_ids, positions, slot_mapping, context_lens, block_tables = self._views(self.inputs)
        slot_mapping.fill_(-1)      # the warm-ups and uploads below write no cache slot
        pool = None
        for size in reversed(self.sizes):
            metadata = backend.decode_metadata(slot_mapping[:size], context_lens[:size], block_tables[:size])
            with use_metadata(metadata):
                self.outputs[:size] = model(input_ids[:size], positions[:size])   # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.outputs[:size] = model(input_ids[:size], positions[:size])
            pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize(device)
        # A graph's first launch also uploads it to the device while the host waits: do that now,
        # not on the first step of each batch size.
        for graph in self.graphs.values():
            graph.replay()
        torch.cuda.synchronize(device)

    def size_for(self, inputs: StepInputs) -> int:
        """The captured batch size that serves this step, or 0 to run it eagerly."""
        if inputs.is_prefill or inputs.num_seqs > self.sizes[-1]:
            return 0
        return next(size for size in self.sizes if size >= inputs.num_seqs)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        largest = self.sizes[-1]
        ids, pos, slots, lens, tables = flat.split([largest] * 4 + [largest * self.width])
        return [ids, pos, slots, lens, tables.view(largest, self.width)]

    def replay(self, inputs: StepInputs, size: int,
               read_pending_tokens: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        n = inputs.num_seqs
        host = self.inputs_host[0]
        self.inputs_host.reverse()
        input_ids, positions, slot_mapping, context_lens, block_tables = self._views(host)
        input_ids[:n] = torch.from_numpy(inputs.input_ids)
        input_ids[n:size] = 0
        positions[:n] = torch.from_numpy(inputs.positions)
        slot_mapping[:n] = torch.from_numpy(inputs.slot_mapping)
        slot_mapping[n:size] = -1                     # padding rows write nothing ...
        context_lens[:n] = torch.from_numpy(inputs.context_lens)
        context_lens[n:size] = 0                      # ... and read nothing
        block_tables[:n, :inputs.block_tables.shape[1]] = torch.from_numpy(inputs.block_tables)
        self.inputs.copy_(host, non_blocking=True)
        if inputs.input_ids.min() < 0:
            ids = self.inputs[:n]                     # the input-id view comes first
            ids.copy_(read_pending_tokens(ids))
        self.graphs[size].replay()
        return self.outputs[:n]
