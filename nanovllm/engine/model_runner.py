"""The device side of the engine: weights, the KV pool, step inputs, CUDA graphs, sampling.

It turns a ScheduledBatch into flat arrays (StepInputs), runs the model, and samples one token for
every sequence whose prompt is fully computed. It never decides what runs; the scheduler does.
"""
import contextlib
import os
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
import xxhash

from nanovllm.config import Config
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels.paged_attention import decode_num_splits
from nanovllm.layers.attention import Attention, choose_attention_backend
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.context import AttentionContext, set_context
from nanovllm.utils.loader import load_model

CPU_KV_CACHE_SHARE = 0.25   # of physical memory, when the CPU pool is sized automatically


@dataclass(slots=True)
class StepInputs:
    """Everything the model needs for one step, as flat host arrays (cheap to ship to TP workers)."""
    is_prefill: bool
    input_ids: np.ndarray       # [num_tokens]
    positions: np.ndarray       # [num_tokens]
    slot_mapping: np.ndarray    # [num_tokens] cache slot of each token
    context_lens: np.ndarray    # [num_seqs] cached + new tokens
    cu_seqlens_q: np.ndarray    # [num_seqs + 1] where each sequence's new tokens start
    block_tables: np.ndarray    # [num_seqs, max_blocks], padded with 0
    logits_indices: np.ndarray  # rows whose next token is sampled (last token of a finished prompt)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, 512)
    return [b for b in (1, 2, 4, 8) if b < largest] + list(range(16, largest, 16)) + [largest]


def padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), lens.max()), dtype=np.int64)
    out[np.arange(lens.max()) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int64,
                                                             count=int(lens.sum()))
    return out


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        self.config = config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = config.min_kvcache_blocks
        if config.device == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        hf_config = config.hf_config
        with torch.device(self.device), default_dtype(config.torch_dtype):
            self.model = Qwen3ForCausalLM(hf_config)
        load_model(self.model, config.model)
        self.model.eval()
        self.sampler = Sampler()
        self.unseeded = np.random.default_rng()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = choose_attention_backend(self.device)
        for attn in self.attention_layers:
            attn.backend = backend
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.is_cuda else 1
        self.num_kvcache_blocks = self._allocate_kv_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.is_cuda and not config.enforce_eager:
            self._capture_decode_graphs()

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- KV pool -------------------------------------------------------------------------------

    def _kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_token = 2 * len(self.attention_layers) * layer.num_kv_heads * layer.head_dim
        return per_token * self.block_size * self.config.torch_dtype.itemsize

    def _allocate_kv_cache(self) -> int:
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks == -1:
            num_blocks = self._blocks_that_fit()
        layer = self.attention_layers[0]
        self.kv_cache = torch.zeros(2, len(self.attention_layers), num_blocks, self.block_size,
                                    layer.num_kv_heads, layer.head_dim, dtype=self.config.torch_dtype,
                                    device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    def _blocks_that_fit(self) -> int:
        config = self.config
        if not self.is_cuda:
            budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_KV_CACHE_SHARE
            wanted = config.max_num_seqs * self.max_blocks_per_seq
            return max(config.min_kvcache_blocks, min(wanted, int(budget // self._kv_block_bytes())))
        # Run the largest step without a cache, then give what is left to KV blocks.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup()
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        not_torch = total - free - torch.cuda.memory_reserved(self.device)
        available = total * config.gpu_memory_utilization - not_torch - peak
        num_blocks = int(available // self._kv_block_bytes())
        if num_blocks < config.min_kvcache_blocks:
            raise ValueError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} leaves room for {max(num_blocks, 0)} KV "
                f"blocks, fewer than the {config.min_kvcache_blocks} one sequence of max_model_len needs")
        return num_blocks

    @torch.inference_mode()
    def _warmup(self) -> None:
        config = self.config
        seq_len = min(config.max_model_len, config.max_num_batched_tokens)
        lens = [seq_len] * (config.max_num_batched_tokens // seq_len)
        if config.max_num_batched_tokens % seq_len:
            lens.append(config.max_num_batched_tokens % seq_len)
        lens = lens[:config.max_num_seqs]
        cu = np.concatenate([[0], np.cumsum(lens)])
        num_tokens = int(cu[-1])
        inputs = StepInputs(True, np.zeros(num_tokens, np.int64), np.concatenate([np.arange(n) for n in lens]),
                            np.full(num_tokens, -1), np.array(lens), cu, np.zeros((len(lens), 1), np.int64),
                            cu[1:] - 1)
        self.execute(inputs)
        # the largest decode batch's logits and sampling
        hidden = torch.zeros(config.max_num_seqs, config.hf_config.hidden_size, device=self.device)
        logits = self.model.compute_logits(hidden.to(config.torch_dtype))
        rows = config.max_num_seqs
        self.sampler(logits, SamplingTensors(torch.ones(rows, device=self.device),
                                             torch.zeros(rows, dtype=torch.int64, device=self.device)))
        torch.cuda.synchronize(self.device)

    # ---- one step ------------------------------------------------------------------------------

    def prepare_step(self, batch: ScheduledBatch) -> StepInputs:
        seqs = batch.seqs
        q_lens = np.array(batch.num_new_tokens, dtype=np.int64)
        starts = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
        context_lens = starts + q_lens
        cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_seqlens_q[1:])
        if batch.is_prefill:
            input_ids = np.concatenate([seq.token_ids[a:a + n] for seq, a, n in zip(seqs, starts, q_lens)])
            positions = np.arange(cu_seqlens_q[-1]) - np.repeat(cu_seqlens_q[:-1] - starts, q_lens)
        else:
            input_ids = np.array([seq.last_token_id for seq in seqs], dtype=np.int64)
            positions = context_lens - 1
        block_tables = padded_block_tables([seq.block_table for seq in seqs])
        seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        slot_mapping = (block_tables[seq_of_token, positions // self.block_size] * self.block_size
                        + positions % self.block_size)
        completes_prompt = context_lens == np.array([seq.num_tokens for seq in seqs])
        return StepInputs(batch.is_prefill, input_ids.astype(np.int64), positions, slot_mapping, context_lens,
                          cu_seqlens_q, block_tables, cu_seqlens_q[1:][completes_prompt] - 1)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], list[dict[int, float] | None]]:
        """Compute one scheduled step; returns the sampled token of each sequence (None for a
        prompt chunk that is not the last) and, where asked for, its logprobs."""
        inputs = self.prepare_step(batch)
        logits = self.execute(inputs)
        sampled_seqs = [seq for seq, n in zip(batch.seqs, batch.num_new_tokens)
                        if seq.num_computed_tokens + n == seq.num_tokens]
        tokens: list[int | None] = [None] * len(batch.seqs)
        logprobs: list[dict[int, float] | None] = [None] * len(batch.seqs)
        if not sampled_seqs:
            return tokens, logprobs
        out = self.sampler(logits, self.prepare_sampling(sampled_seqs))
        row_of_seq = {id(seq): row for row, seq in enumerate(sampled_seqs)}
        token_ids = out.token_ids.tolist()
        seq_logprobs = self._logprobs_by_row(out, sampled_seqs)
        for i, seq in enumerate(batch.seqs):
            row = row_of_seq.get(id(seq))
            if row is not None:
                tokens[i], logprobs[i] = token_ids[row], seq_logprobs[row]
        return tokens, logprobs

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run the model on one step's inputs; logits of the sampled rows (on rank 0)."""
        num_tokens = len(inputs.input_ids)
        graph_size = self._graph_size(inputs)
        if graph_size:
            hidden = self._replay_decode_graph(inputs, graph_size)
        else:
            input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, block_tables = self._to_device(
                inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.context_lens,
                inputs.cu_seqlens_q, inputs.block_tables)
            q_lens = np.diff(inputs.cu_seqlens_q)
            set_context(AttentionContext(
                is_prefill=inputs.is_prefill, slot_mapping=slot_mapping, context_lens=context_lens,
                block_tables=block_tables, cu_seqlens_q=cu_seqlens_q.int(),
                max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(inputs.context_lens.max()),
                has_cached_context=bool((inputs.context_lens > q_lens).any()),
                num_splits=decode_num_splits(inputs.num_seqs, self.attention_layers[0].num_kv_heads, self.num_sms)
                if self.is_cuda else 1))
            hidden = self.model(input_ids, positions)
        set_context(None)
        rows = inputs.logits_indices
        if len(rows) != num_tokens:
            hidden = hidden[torch.from_numpy(rows).to(self.device, non_blocking=True)]
        return self.model.compute_logits(hidden)

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """One host-to-device copy for all of a step's int arrays."""
        flat = np.concatenate([a.ravel() for a in arrays]).astype(np.int64)
        data = torch.from_numpy(flat)
        if self.is_cuda:
            data = data.pin_memory().to(self.device, non_blocking=True)
        out, offset = [], 0
        for a in arrays:
            out.append(data[offset:offset + a.size].view(a.shape))
            offset += a.size
        return out

    # ---- sampling inputs -----------------------------------------------------------------------

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [seq.sampling_params for seq in seqs]
        n = len(seqs)
        tensor = lambda values: torch.from_numpy(values).to(self.device, non_blocking=True)  # noqa: E731
        temperatures = np.fromiter((p.temperature for p in params), dtype=np.float32, count=n)
        all_greedy = not temperatures.any()
        seeds = np.zeros(n, dtype=np.int64) if all_greedy else self.unseeded.integers(0, 2**63 - 1, n)
        for row, p in enumerate(params):
            if p.seed is not None:
                # a seeded request's noise depends only on its seed and how many tokens it has made
                seeds[row] = xxhash.xxh64_intdigest(f"{p.seed}/{seqs[row].num_completion_tokens}".encode()) >> 1
        sampling = SamplingTensors(tensor(temperatures), tensor(seeds), all_greedy)
        top_k = np.fromiter((p.top_k for p in params), dtype=np.int64, count=n)
        if (top_k > 0).any():
            sampling.top_k = tensor(np.where(top_k > 0, top_k, self.config.hf_config.vocab_size))
        top_p = np.fromiter((p.top_p for p in params), dtype=np.float32, count=n)
        if (top_p < 1).any():
            sampling.top_p = tensor(top_p)
        min_p = np.fromiter((p.min_p for p in params), dtype=np.float32, count=n)
        if min_p.any():
            sampling.min_p = tensor(min_p)
        sampling.banned_tokens = {row: self._banned_tokens(seq) for row, seq in enumerate(seqs)
                                  if seq.sampling_params.min_tokens and
                                  seq.num_completion_tokens < seq.sampling_params.min_tokens}
        asked = [p.logprobs for p in params if p.logprobs is not None]
        sampling.max_logprobs = max(asked) if asked else None
        return sampling

    def _banned_tokens(self, seq: Sequence) -> list[int]:
        params = seq.sampling_params
        eos = [] if params.ignore_eos else list(self.config.eos_token_ids)
        return eos + params.stop_token_ids

    @staticmethod
    def _logprobs_by_row(out: SamplerOutput, seqs: list[Sequence]) -> list[dict[int, float] | None]:
        if out.logprobs is None:
            return [None] * len(seqs)
        chosen, ids = out.token_ids.tolist(), out.top_token_ids.tolist()
        chosen_lp, top_lp = out.logprobs.tolist(), out.top_logprobs.tolist()
        result = []
        for row, seq in enumerate(seqs):
            n = seq.sampling_params.logprobs
            if n is None:
                result.append(None)
                continue
            entry = dict(zip(ids[row][:n], top_lp[row][:n]))
            entry[chosen[row]] = chosen_lp[row]
            result.append(entry)
        return result

    # ---- CUDA graphs for decode ----------------------------------------------------------------

    def _graph_size(self, inputs: StepInputs) -> int:
        """The captured batch size that serves this step, or 0 to run eagerly."""
        if inputs.is_prefill or not self.graphs or inputs.num_seqs > self.graph_sizes[-1]:
            return 0
        return next(size for size in self.graph_sizes if size >= inputs.num_seqs)

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        hf_config = self.config.hf_config
        self.graph_sizes = graph_batch_sizes(self.config.max_num_seqs)
        largest, width = self.graph_sizes[-1], self.max_blocks_per_seq
        # one int64 buffer, so a replay needs a single host-to-device copy
        self.graph_inputs = torch.zeros(largest * (4 + width), dtype=torch.int64, device=self.device)
        self.graph_inputs_host = torch.zeros(self.graph_inputs.shape, dtype=torch.int64).pin_memory()
        input_ids, positions, slot_mapping, context_lens, block_tables = self._graph_views(self.graph_inputs)
        self.graph_outputs = torch.zeros(largest, hf_config.hidden_size, dtype=self.config.torch_dtype,
                                         device=self.device)
        num_kv_heads = self.attention_layers[0].num_kv_heads
        pool = None
        for size in reversed(self.graph_sizes):
            set_context(AttentionContext(is_prefill=False, slot_mapping=slot_mapping[:size],
                                         context_lens=context_lens[:size], block_tables=block_tables[:size],
                                         num_splits=decode_num_splits(size, num_kv_heads, self.num_sms)))
            self.graph_outputs[:size] = self.model(input_ids[:size], positions[:size])   # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.graph_outputs[:size] = self.model(input_ids[:size], positions[:size])
            pool = graph.pool()
            self.graphs[size] = graph
            torch.cuda.synchronize(self.device)
        set_context(None)

    def _graph_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        largest = self.graph_sizes[-1]
        ids, pos, slots, lens, tables = flat.split([largest] * 4 + [largest * self.max_blocks_per_seq])
        return [ids, pos, slots, lens, tables.view(largest, self.max_blocks_per_seq)]

    def _replay_decode_graph(self, inputs: StepInputs, size: int) -> torch.Tensor:
        n = inputs.num_seqs
        input_ids, positions, slot_mapping, context_lens, block_tables = self._graph_views(self.graph_inputs_host)
        input_ids[:n] = torch.from_numpy(inputs.input_ids)
        positions[:n] = torch.from_numpy(inputs.positions)
        slot_mapping[:n] = torch.from_numpy(inputs.slot_mapping)
        slot_mapping[n:size] = -1                     # padding rows write nothing ...
        context_lens[:n] = torch.from_numpy(inputs.context_lens)
        context_lens[n:size] = 0                      # ... and read nothing
        block_tables[:n, :inputs.block_tables.shape[1]] = torch.from_numpy(inputs.block_tables)
        self.graph_inputs.copy_(self.graph_inputs_host, non_blocking=True)
        self.graphs[size].replay()
        return self.graph_outputs[:n]
