"""The device side of the engine: weights, the KV pool, step inputs, CUDA graphs, sampling.

It turns a ScheduledBatch into flat arrays (StepInputs), runs the model, and samples one token for
every sequence whose prompt is fully computed. It never decides what runs; the scheduler does.
"""
import contextlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from itertools import chain
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from nanovllm.config import Config
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.kernels.paged_attention import decode_num_splits
from nanovllm.layers.attention import Attention, choose_attention_backend
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM
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


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: the sequences it samples, in row order, and host copies of its
    sampler output that are valid once `done` has passed."""
    seqs: list[Sequence]
    out: SamplerOutput | None = None
    done: torch.cuda.Event | None = None


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    largest = min(max_num_seqs, 512)
    return [b for b in (1, 2, 4, 8) if b < largest] + list(range(16, largest, 16)) + [largest]


def padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    out = np.zeros((len(tables), lens.max()), dtype=np.int64)
    out[np.arange(lens.max()) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int64,
                                                             count=int(lens.sum()))
    return out


def pending_token_marker(row: int) -> int:
    """The input id that stands for a token still on the device: row `row` of the last sampler output."""
    return -1 - row


def step_token_ids(seq: Sequence, start: int, end: int) -> list[int]:
    """Input ids of seq's tokens [start, end), the pending one (if in range) as its marker."""
    ids = seq.token_ids[start:end]
    if seq.pending_row is not None and end == seq.num_tokens:
        ids.append(pending_token_marker(seq.pending_row))
    return ids


@contextlib.contextmanager
def deferred_keyboard_interrupt():
    """Hold back a Ctrl-C (SIGINT) until the block ends, then raise it. Only the main thread gets
    signals, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(previous):
            previous(signal.SIGINT, None)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class ModelRunner:
    """One rank's runner. Rank 0 (in the engine's process) starts the other ranks as worker
    processes and sends them every step's StepInputs; they only run the model."""

    def __init__(self, config: Config, rank: int = 0, init_method: str | None = None,
                 conn: Connection | None = None):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = config.min_kvcache_blocks
        if config.device == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.workers: list[Worker] = []
        self.needs_restart = False    # ranks went out of step (see _execute_with_workers)
        if self.world_size > 1:
            if rank == 0:
                init_method, self.workers = start_workers(config)
                self._stop_workers = weakref.finalize(self, stop_workers, self.workers)
            if not self.is_cuda:   # ranks share the cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
            dist.init_process_group("nccl" if self.is_cuda else "gloo", init_method=init_method,
                                    world_size=self.world_size, rank=rank, timeout=timedelta(minutes=10))
        hf_config = config.hf_config
        with torch.device(self.device), default_dtype(config.torch_dtype):
            moe = hf_config.architectures[0] == "Qwen3MoeForCausalLM"
            self.model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(hf_config)
        load_model(self.model, config.model)
        self.model.eval()
        if conn is not None:
            conn.send(LOADED)
        for worker in self.workers:     # before the first collective, which would hang on a dead rank
            worker.expect(LOADED)
        self.sampler = Sampler()
        self.unseeded = np.random.default_rng()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = choose_attention_backend(self.device)
        for attn in self.attention_layers:
            attn.backend = backend
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.is_cuda else 1
        self.num_kvcache_blocks = self._allocate_kv_cache()
        if self.is_cuda:
            self._run_cached_prefill()
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
            if self.world_size > 1:        # one block manager serves every rank
                fewest = torch.tensor([num_blocks], device=self.device)
                dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
                num_blocks = int(fewest.item())
            if num_blocks < self.config.min_kvcache_blocks:
                raise ValueError(
                    f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves room for "
                    f"{max(num_blocks, 0)} KV blocks, fewer than the {self.config.min_kvcache_blocks} "
                    f"one sequence of max_model_len needs")
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
            budget = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_KV_CACHE_SHARE / self.world_size
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
        return int(available // self._kv_block_bytes())

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
        if self.rank == 0:
            self.sampler(logits, SamplingTensors(torch.ones(rows, device=self.device),
                                                 torch.zeros(rows, dtype=torch.int64, device=self.device)))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _run_cached_prefill(self) -> None:
        """One prefill token over one cached one, writing nothing: compiles the kernels of that path
        (prefix-cache hits, later chunks of a prompt) now, not in the middle of the first requests.
        The memory warm-up cannot: it runs before the cache exists."""
        self.execute(StepInputs(True, np.zeros(1, np.int64), np.array([1]), np.array([-1]), np.array([2]),
                                np.array([0, 1]), np.zeros((1, 1), np.int64), np.array([0])))

    # ---- one step ------------------------------------------------------------------------------

    def prepare_step(self, batch: ScheduledBatch) -> StepInputs:
        seqs = batch.seqs
        size = self.block_size
        block_tables = padded_block_tables([seq.block_table for seq in seqs])
        if not batch.is_prefill:     # one token per sequence, its last; every sequence samples
            lens_and_tokens = np.array([(seq.num_tokens, seq.token_ids[-1] if seq.pending_row is None
                                         else pending_token_marker(seq.pending_row)) for seq in seqs], dtype=np.int64)
            context_lens, input_ids = lens_and_tokens[:, 0], lens_and_tokens[:, 1]
            positions = context_lens - 1
            slot_mapping = block_tables[np.arange(len(seqs)), positions // size] * size + positions % size
            cu_seqlens_q = np.arange(len(seqs) + 1)
            return StepInputs(False, input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, block_tables,
                              cu_seqlens_q[:-1])
        q_lens = np.array(batch.num_new_tokens, dtype=np.int64)
        starts = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)
        context_lens = starts + q_lens
        cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_seqlens_q[1:])
        input_ids = np.concatenate([step_token_ids(seq, a, a + n) for seq, a, n in zip(seqs, starts, q_lens)])
        positions = np.arange(cu_seqlens_q[-1]) - np.repeat(cu_seqlens_q[:-1] - starts, q_lens)
        seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        slot_mapping = block_tables[seq_of_token, positions // size] * size + positions % size
        completes_prompt = context_lens == np.array([seq.num_tokens for seq in seqs])
        return StepInputs(True, input_ids.astype(np.int64), positions, slot_mapping, context_lens,
                          cu_seqlens_q, block_tables, cu_seqlens_q[1:][completes_prompt] - 1)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue one scheduled step (model and sampling) on the device and return without waiting,
        so the host can prepare the next step while this one runs."""
        inputs = self.prepare_step(batch)
        if self.workers:
            logits = self._execute_with_workers(inputs)
        else:
            logits = self.execute(inputs)
        seqs = batch.sampled_seqs()
        if not seqs:
            return LaunchedStep(seqs)
        out = self.sampler(logits, self.prepare_sampling(seqs))
        self.last_token_ids = out.token_ids      # the next step reads its pending tokens from here
        to_host = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        host = SamplerOutput(to_host(out.token_ids), to_host(out.logprobs), to_host(out.top_logprobs),
                             to_host(out.top_token_ids))
        done = torch.cuda.Event() if self.is_cuda else None
        if done is not None:
            done.record()
        return LaunchedStep(seqs, host, done)

    def _execute_with_workers(self, inputs: StepInputs) -> torch.Tensor | None:
        """Send a step to the workers and run rank 0's share. A Ctrl-C waits until the step is done
        (the ranks must meet in every collective); any other failure once the workers have the step
        leaves the ranks apart, so the engine must start them anew (needs_restart)."""
        with deferred_keyboard_interrupt():
            for worker in self.workers:
                worker.send(inputs)
            try:
                return self.execute(inputs)
            except BaseException as error:
                for worker in self.workers:   # a collective failing because a rank died says so
                    worker.process.join(timeout=1)
                    worker.check_alive()
                self.needs_restart = True
                raise error

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[dict[int, float] | None]]:
        """Wait for a launched step; the token (and logprobs, where asked) of each sampled sequence."""
        if not step.seqs:
            return [], []
        self._wait_for_device(step.done)
        return step.out.token_ids.tolist(), self._logprobs_by_row(step.out, step.seqs)

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
            if inputs.input_ids.min() < 0:
                input_ids = self._read_pending_tokens(input_ids)
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
            hidden = hidden[self._host_to_device(rows)]
        return self.model.compute_logits(hidden)

    def _wait_for_device(self, done: torch.cuda.Event | None) -> None:
        """With workers on GPUs, a dead rank would leave a step hanging in NCCL: wait by polling."""
        if done is None:
            return
        if not self.workers:
            done.synchronize()
            return
        while not done.query():
            for worker in self.workers:
                worker.check_alive()
            time.sleep(0.0001)

    def close(self) -> None:
        """Stop the workers (rank 0), leave the process group and free this rank's device memory."""
        if self.workers:
            if self.needs_restart:     # the workers wait in a collective rank 0 left: do not wait for them
                for worker in self.workers:
                    worker.process.kill()
            self._stop_workers()
        clean = all(worker.process.exitcode == 0 for worker in self.workers)
        set_context(None)
        self.graphs.clear()
        self.model = self.kv_cache = self.graph_inputs = self.graph_outputs = self.last_token_ids = None
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        if dist.is_initialized():
            if clean:
                dist.destroy_process_group()
            else:   # a rank died: do not wait for it (a plain destroy can hang on NCCL)
                try:
                    dist.distributed_c10d._abort_process_group()
                except (AttributeError, RuntimeError):
                    dist.destroy_process_group()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def _read_pending_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids -1 - row stand for tokens the previous step sampled, still only on the device."""
        rows = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.last_token_ids[rows], input_ids)

    def _host_to_device(self, array: np.ndarray) -> torch.Tensor:
        """Through pinned memory, so the copy neither waits for the device nor holds up the host."""
        data = torch.from_numpy(array)
        return data.pin_memory().to(self.device, non_blocking=True) if self.is_cuda else data

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """One host-to-device copy for all of a step's int arrays."""
        data = self._host_to_device(np.concatenate([a.ravel() for a in arrays]).astype(np.int64))
        out, offset = [], 0
        for a in arrays:
            out.append(data[offset:offset + a.size].view(a.shape))
            offset += a.size
        return out

    # ---- sampling inputs -----------------------------------------------------------------------

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [seq.sampling_params for seq in seqs]
        values = np.array([(p.temperature, p.top_p, p.min_p) for p in params], dtype=np.float64)
        temperatures, top_p, min_p = values.T
        vocab_size = self.config.hf_config.vocab_size
        top_k = np.array([min(p.top_k, vocab_size) if p.top_k > 0 else 0 for p in params], dtype=np.int64)
        all_greedy = not temperatures.any()
        seeds = np.zeros(len(seqs), dtype=np.int64) if all_greedy else self.unseeded.integers(0, 2**63 - 1, len(seqs))
        banned, asked = {}, []
        for row, p in enumerate(params):   # most rows ask for none of these; skip them cheaply
            if p.seed is None and not p.min_tokens and p.logprobs is None:
                continue
            num_generated = seqs[row].num_completion_tokens
            if p.seed is not None and not all_greedy:
                # a seeded request's noise depends only on its seed and how many tokens it has made
                seeds[row] = xxhash.xxh64_intdigest(f"{p.seed}/{num_generated}".encode()) >> 1
            if num_generated < p.min_tokens:
                banned[row] = self._banned_tokens(seqs[row])
            if p.logprobs is not None:
                asked.append(p.logprobs)
        tensor = self._host_to_device
        sampling = SamplingTensors(tensor(temperatures.astype(np.float32)), tensor(seeds), all_greedy,
                                   banned_tokens=banned, max_logprobs=max(asked) if asked else None)
        if (top_k > 0).any():
            sampling.top_k = tensor(np.where(top_k > 0, top_k, vocab_size))
        if (top_p < 1).any():
            sampling.top_p = tensor(top_p.astype(np.float32))
        if min_p.any():
            sampling.min_p = tensor(min_p.astype(np.float32))
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
        # two host buffers, used in turn: the copy of the step still queued may read the other
        self.graph_inputs_host = [torch.zeros(self.graph_inputs.shape, dtype=torch.int64).pin_memory()
                                  for _ in range(2)]
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
        host = self.graph_inputs_host[0]
        self.graph_inputs_host.reverse()
        input_ids, positions, slot_mapping, context_lens, block_tables = self._graph_views(host)
        input_ids[:n] = torch.from_numpy(inputs.input_ids)
        input_ids[n:size] = 0
        positions[:n] = torch.from_numpy(inputs.positions)
        slot_mapping[:n] = torch.from_numpy(inputs.slot_mapping)
        slot_mapping[n:size] = -1                     # padding rows write nothing ...
        context_lens[:n] = torch.from_numpy(inputs.context_lens)
        context_lens[n:size] = 0                      # ... and read nothing
        block_tables[:n, :inputs.block_tables.shape[1]] = torch.from_numpy(inputs.block_tables)
        self.graph_inputs.copy_(host, non_blocking=True)
        if inputs.input_ids.min() < 0:
            ids = self.graph_inputs[:n]           # the input-id view comes first
            ids.copy_(self._read_pending_tokens(ids))
        self.graphs[size].replay()
        return self.graph_outputs[:n]


# ---- tensor-parallel workers ----------------------------------------------------------------------

LOADED = "loaded"


@dataclass
class Worker:
    """Rank 0's handle on a worker process and the pipe that carries its steps."""
    rank: int
    process: mp.Process
    conn: Connection

    def check_alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"tensor-parallel worker {self.rank} died (exit code {self.process.exitcode}); "
                               "this engine cannot continue, shut it down and start a new one")

    def send(self, inputs: StepInputs) -> None:
        self.check_alive()
        self.conn.send(inputs)

    def expect(self, message: str) -> None:
        while not self.conn.poll(0.05):
            self.check_alive()
        received = self.conn.recv()
        if received != message:
            raise RuntimeError(f"tensor-parallel worker {self.rank} failed to start:\n{received}")


def start_workers(config: Config) -> tuple[str, list[Worker]]:
    with socket.socket() as s:           # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    context = mp.get_context("spawn")
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        parent_end, child_end = context.Pipe()
        process = context.Process(target=worker_main, args=(config, rank, init_method, child_end),
                                  name=f"nanovllm-tp-rank{rank}", daemon=True)
        process.start()
        child_end.close()
        workers.append(Worker(rank, process, parent_end))
    return init_method, workers


def stop_workers(workers: list[Worker]) -> None:
    for worker in workers:
        if worker.process.is_alive():
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
    for worker in workers:
        worker.process.join(timeout=30)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()


def worker_main(config: Config, rank: int, init_method: str, conn: Connection) -> None:
    """A worker rank: build the same model shard, then run every step rank 0 sends until told to stop."""
    try:
        runner = ModelRunner(config, rank, init_method, conn)
    except BaseException:
        conn.send(traceback.format_exc())
        return
    try:
        while (inputs := conn.recv()) is not None:
            runner.execute(inputs)
    except EOFError:                      # rank 0's process is gone
        pass
    finally:
        runner.close()
