"""The device side of the engine: launch a scheduled step, collect its tokens.

It turns a ScheduledBatch into StepInputs (step_inputs.py), runs the model (eagerly, or by replaying
a CUDA graph for decode: cuda_graph.py) over the paged pool (kv_cache.py), and samples one token for
every sequence whose prompt is fully computed (sampling_inputs.py); a verify step (speculative
decoding) runs eagerly and samples every position of each sequence, keeping a prefix of its
proposals (spec_decode/rejection_sampler.py). Under tensor parallelism rank 0 also sends each step
to the worker processes (tp.py). It never decides what runs; the scheduler does.
"""
import contextlib
import math
import os
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.attention import choose_attention_backend, use_metadata
from nanovllm.config import Config
from nanovllm.engine.scheduler import SPECULATION_MAX_RUNNING, ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.structured_output import TokenBitmask
from nanovllm.kernels.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from nanovllm.layers.attention import Attention
from nanovllm.layers.sampler import Sampler, SamplerOutput, SamplingTensors
from nanovllm.models.registry import build_model
from nanovllm.spec_decode.rejection_sampler import rejection_sample
from nanovllm.spec_decode.verify_inputs import build_verify_tensors, verify_rows
from nanovllm.utils.loader import load_model, weight_bytes
from nanovllm.worker.cuda_graph import StepGraphs
from nanovllm.worker.kv_cache import KVCache, cpu_budget_bytes
from nanovllm.worker.kv_offload import HostKVCache
from nanovllm.worker.sampling_inputs import build_sampling_tensors, logprobs_by_row
from nanovllm.worker.step_inputs import StepInputs, build_step_inputs
from nanovllm.worker.tp import LOADED, Worker, deferred_keyboard_interrupt, start_workers, stop_workers


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: the sequences it samples, in row order, and host copies of its
    sampler output that are valid once `done` has passed. Launched without sampling, it holds its
    logits and sampling tensors until `ModelRunner.sample` (token masks come later)."""
    seqs: list[Sequence]
    out: SamplerOutput | None = None
    done: torch.cuda.Event | None = None
    draft_lens: list[int] | None = None          # a verify step: proposals per sequence; out has a
    num_accepted: torch.Tensor | None = None     # row per position, and these were accepted
    logits: torch.Tensor | None = None
    sampling: SamplingTensors | None = None


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
                 conn: Connection | None = None, multi_token_len: int | None = None):
        self.config = config
        self.rank = rank
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        if config.device == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.workers: list[Worker] = []
        self.graphs: list[StepGraphs] = []     # captured last, once the pool exists
        self.needs_restart = False    # ranks went out of step (see _execute_with_workers)
        if self.world_size > 1:
            if rank == 0:
                init_method, self.workers = start_workers(config, ModelRunner)
                self._stop_workers = weakref.finalize(self, stop_workers, self.workers)
            if not self.is_cuda:   # ranks share the cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
            dist.init_process_group("nccl" if self.is_cuda else "gloo", init_method=init_method,
                                    world_size=self.world_size, rank=rank, timeout=timedelta(minutes=10))
        with torch.device(self.device), default_dtype(config.torch_dtype):
            self.model = build_model(config.model_config)
        checkpoint_kv_scales = load_model(self.model, config)
        self.model.eval()
        self.weight_bytes = weight_bytes(self.model)   # this rank's
        if conn is not None:
            conn.send(LOADED)
        for worker in self.workers:     # before the first collective, which would hang on a dead rank
            worker.expect(LOADED)
        self.sampler = Sampler()
        self.unseeded = np.random.default_rng()
        self.last_token_ids: torch.Tensor | None = None   # the last sampler output, on the device
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else config.torch_dtype
        self.backend = choose_attention_backend(self.device, self.attention_layers[0].num_kv_heads, kv_dtype)
        for attn in self.attention_layers:
            attn.backend = self.backend
        self.kv_cache = KVCache(self.attention_layers, self.block_size, kv_dtype, self.device)
        self.host_kv_cache = self._allocate_host_tier()      # before sizing: its staging takes device memory
        self.num_kvcache_blocks = self._size_kv_cache()
        if self.kv_cache.is_fp8 and not self._use_checkpoint_kv_scales(checkpoint_kv_scales):
            self._calibrate_kv_scales()
        self.kv_cache.allocate(self.num_kvcache_blocks)
        if self.is_cuda:
            self._run_cached_prefill()
        if self.is_cuda and not config.enforce_eager:
            self._capture_graphs(multi_token_len)

    def _capture_graphs(self, multi_token_len: int | None) -> None:
        """Decode graphs, and with speculation graphs of verify steps (k + 1 tokens per sequence) for
        the batches that speculate."""
        config = self.config
        if multi_token_len is None:
            spec = config.speculative_config
            multi_token_len = spec.num_speculative_tokens + 1 if spec is not None else 1
        shape = (config.min_kvcache_blocks, config.model_config.hidden_size, config.torch_dtype, self.device)
        decode = StepGraphs(self.model, self.backend, config.max_num_seqs, *shape)
        self.graphs = [decode]
        if multi_token_len > 1:
            self.graphs.append(StepGraphs(self.model, self.backend, min(config.max_num_seqs, SPECULATION_MAX_RUNNING),
                                          *shape, query_len=multi_token_len, pool=decode.pool))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # ---- KV pool size ----------------------------------------------------------------------------

    def _size_kv_cache(self) -> int:
        config = self.config
        if config.num_kvcache_blocks != -1:
            return config.num_kvcache_blocks
        if self.is_cuda:
            num_blocks = self._blocks_that_fit_on_gpu()
        else:
            wanted = config.max_num_seqs * config.min_kvcache_blocks
            num_blocks = max(config.min_kvcache_blocks,
                             min(wanted, self.kv_cache.blocks_for_bytes(cpu_budget_bytes(self.world_size))))
        if self.world_size > 1:        # one block manager serves every rank
            fewest = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
            num_blocks = int(fewest.item())
        if num_blocks < config.min_kvcache_blocks:
            raise ValueError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} leaves room for "
                f"{max(num_blocks, 0)} KV blocks, fewer than the {config.min_kvcache_blocks} "
                f"one sequence of max_model_len needs")
        return num_blocks

    def _allocate_host_tier(self) -> HostKVCache | None:
        """The prefix cache's host tier (kv_offload_gib, shared by the ranks): None when off."""
        if not self.config.kv_offload_gib:
            return None
        num_blocks = int(self.config.kv_offload_gib * 2**30 / self.world_size // self.kv_cache.block_bytes)
        if num_blocks < 1:
            raise ValueError(f"kv_offload_gib={self.config.kv_offload_gib} holds no KV block "
                             f"({self.kv_cache.block_bytes * self.world_size} bytes over the ranks); pass 0 or more")
        return HostKVCache(self.kv_cache, num_blocks)

    @property
    def num_host_blocks(self) -> int:
        return self.host_kv_cache.num_blocks if self.host_kv_cache else 0

    def _blocks_that_fit_on_gpu(self) -> int:
        """Run the largest step without a cache, then give what is left to KV blocks."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup()
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        not_torch = total - free - torch.cuda.memory_reserved(self.device)
        return self.kv_cache.blocks_for_bytes(total * self.config.gpu_memory_utilization - not_torch - peak)

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
        hidden = torch.zeros(config.max_num_seqs, config.model_config.hidden_size, device=self.device)
        logits = self.model.compute_logits(hidden.to(config.torch_dtype))
        rows = config.max_num_seqs
        if self.rank == 0:     # under grammars' masks (allowing all): compiles that kernel, counts its logits copy
            int32 = dict(dtype=torch.int32, device=self.device)
            self.sampler(logits, SamplingTensors(torch.ones(rows, device=self.device),
                                                 torch.zeros(rows, dtype=torch.int64, device=self.device),
                                                 token_bitmask=torch.full((rows, -(-logits.shape[1] // 32)), -1, **int32),
                                                 bitmask_rows=torch.arange(rows, **int32)))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _run_cached_prefill(self) -> None:
        """One prefill token over one cached one, writing nothing: compiles the kernels of that path
        (prefix-cache hits, later chunks of a prompt) now, not in the middle of the first requests.
        The memory warm-up cannot: it runs before the cache exists."""
        self.execute(StepInputs(True, np.zeros(1, np.int64), np.array([1]), np.array([-1]), np.array([2]),
                                np.array([0, 1]), np.zeros((1, 1), np.int64), np.array([0])))

    def _use_checkpoint_kv_scales(self, scales: dict[int, dict[str, torch.Tensor]]) -> bool:
        """Take the checkpoint's K and V scales if it has both for every layer. A scale per head
        becomes the layer's largest (every rank then agrees, whichever heads it holds)."""
        num_layers = len(self.attention_layers)
        if any(set(scales.get(i, ())) != {"k", "v"} for i in range(num_layers)):
            return False
        for i in range(num_layers):
            for row, which in enumerate("kv"):
                value = float(scales[i][which].max())
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"model: checkpoint {which}_scale of layer {i} is {value}; it must be positive")
                self.kv_cache.scales[row, i] = value
        return True

    @torch.inference_mode()
    def _calibrate_kv_scales(self, num_tokens: int = 512, headroom: float = 2.0) -> None:
        """Scales of a float8 pool: a prefill of fixed pseudo-random tokens through a small pool in
        the model's dtype, then per layer `headroom` times the largest |K| and |V| it stored, over
        448 (e4m3's largest). The headroom keeps later, larger values from clipping; e4m3's error is
        relative, so it costs only the smallest values some precision (docs/fp8_kv_cache.md)."""
        n = min(num_tokens, self.config.max_model_len - 1)
        num_blocks = -(-n // self.block_size)
        probe = KVCache(self.attention_layers, self.block_size, self.config.torch_dtype, self.device)
        probe.allocate(num_blocks)
        token_ids = np.random.default_rng(0).integers(0, self.config.model_config.vocab_size, n)
        positions = np.arange(n)
        self.execute(StepInputs(True, token_ids, positions, positions, np.array([n]), np.array([0, n]),
                                np.arange(num_blocks)[None], np.array([n - 1])))
        absmax = probe.tensor.flatten(2).abs().amax(dim=2).float()     # [K or V, layer]
        probe.release()
        self.kv_cache.scales.copy_((headroom * absmax / FP8_MAX).clamp(min=SCALE_FLOOR).unsqueeze(-1))

    # ---- one step ------------------------------------------------------------------------------

    def prepare_step(self, batch: ScheduledBatch) -> StepInputs:
        inputs = build_step_inputs(batch, self.block_size)
        if batch.kv_offloads or batch.kv_loads:
            inputs.kv_offloads = np.array(batch.kv_offloads, dtype=np.int64).reshape(-1, 2)
            inputs.kv_loads = np.array(batch.kv_loads, dtype=np.int64).reshape(-1, 2)
        return inputs

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingTensors:
        return build_sampling_tensors(seqs, self.config.model_config.vocab_size, self.config.eos_token_ids,
                                      self.unseeded, self._host_to_device)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, sample: bool = True) -> LaunchedStep:
        """Queue one scheduled step (model and, unless `sample` is False, sampling) on the device and
        return without waiting, so the host can prepare the next step while this one runs."""
        inputs = self.prepare_step(batch)
        logits = self._execute_with_workers(inputs) if self.workers else self.execute(inputs)
        seqs = batch.sampled_seqs()
        if not seqs:
            return LaunchedStep(seqs)
        if batch.draft_token_ids is not None:     # a verify step samples at once (never constrained)
            out, num_accepted = self._verify(logits, seqs, batch.draft_token_ids)
            step = LaunchedStep(seqs, draft_lens=list(map(len, batch.draft_token_ids)))
            step.num_accepted = num_accepted.to("cpu", non_blocking=True)
            self._to_host(step, out)
            return step
        step = LaunchedStep(seqs, logits=logits, sampling=self.prepare_sampling(seqs))
        if sample:
            self.sample(step)
        return step

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence],
                drafts: list[list[int]]) -> tuple[SamplerOutput, torch.Tensor]:
        """Rejection-sample a verify step's rows (spec_decode/rejection_sampler.py)."""
        row_seqs, positions = verify_rows(seqs, drafts)
        sampling = build_sampling_tensors(row_seqs, self.config.model_config.vocab_size, self.config.eos_token_ids,
                                          self.unseeded, self._host_to_device, positions)
        verify = build_verify_tensors(drafts, positions, self._host_to_device)
        return rejection_sample(logits, sampling, verify)

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, token_bitmask: TokenBitmask | None = None) -> None:
        """Queue a launched step's sampling, under the grammars' token bitmask if any."""
        if token_bitmask is not None:
            step.sampling.token_bitmask, step.sampling.bitmask_rows = token_bitmask.to(self.device)
        out = self.sampler(step.logits, step.sampling)
        step.logits = step.sampling = None
        self.last_token_ids = out.token_ids      # the next step reads its pending tokens from here
        self._to_host(step, out)

    def _to_host(self, step: LaunchedStep, out: SamplerOutput) -> None:
        """Start copying a step's sampled tokens to the host; `step.done` marks when they are there."""
        to_host = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        step.out = SamplerOutput(to_host(out.token_ids), to_host(out.logprobs), to_host(out.top_logprobs),
                                 to_host(out.top_token_ids))
        step.done = torch.cuda.Event() if self.is_cuda else None
        if step.done is not None:
            step.done.record()

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
        return step.out.token_ids.tolist(), logprobs_by_row(step.out, step.seqs)

    def collect_verified(self, step: LaunchedStep) -> tuple[list[list[int]], list[list[dict[int, float] | None]],
                                                            list[int]]:
        """Wait for a verify step; each sequence's tokens (accepted proposals, then one more), their
        logprobs (entries None where not asked), and how many proposals were accepted."""
        self._wait_for_device(step.done)
        row_seqs, _ = verify_rows(step.seqs, [[0] * n for n in step.draft_lens])
        row_tokens, row_logprobs = step.out.token_ids.tolist(), logprobs_by_row(step.out, row_seqs)
        num_accepted = step.num_accepted.tolist()
        tokens, logprobs, start = [], [], 0
        for drafted, accepted in zip(step.draft_lens, num_accepted):
            tokens.append(row_tokens[start:start + accepted + 1])
            logprobs.append(row_logprobs[start:start + accepted + 1])
            start += drafted + 1
        return tokens, logprobs, num_accepted

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run the model on one step's inputs; logits of the sampled rows (on rank 0)."""
        if len(inputs.kv_offloads) or len(inputs.kv_loads):    # the prefix cache's host tier
            self.host_kv_cache.transfer(inputs.kv_offloads, inputs.kv_loads)
        if len(inputs.block_copies):    # copy-on-write of blocks shared by forked sequences
            self.kv_cache.copy_blocks(self._host_to_device(inputs.block_copies))
        graphs, size = next(((graphs, size) for graphs in self.graphs if (size := graphs.size_for(inputs))),
                            (None, 0))
        if graphs is not None:
            hidden, rows = graphs.replay(inputs, size, self.read_pending_tokens)
        else:
            input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, block_tables = self._to_device(
                inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.context_lens,
                inputs.cu_seqlens_q, inputs.block_tables)
            if inputs.input_ids.min() < 0:
                input_ids = self.read_pending_tokens(input_ids)
            metadata = self.backend.metadata(inputs.is_prefill, slot_mapping, context_lens, block_tables,
                                             cu_seqlens_q, inputs.context_lens, inputs.cu_seqlens_q)
            with use_metadata(metadata):
                hidden = self.model(input_ids, positions)
            rows = inputs.logits_indices
        if len(rows) != len(hidden):
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
        self.graphs, self.model, self.last_token_ids = [], None, None
        self.kv_cache.release()
        if self.host_kv_cache is not None:
            self.host_kv_cache.release()
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

    def read_pending_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids -1 - row stand for tokens the previous step sampled, still only on the device."""
        rows = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.last_token_ids[rows], input_ids)

    def _host_to_device(self, array: np.ndarray) -> torch.Tensor:
        """Through pinned memory, so the copy neither waits for the device nor holds up the host."""
        data = torch.from_numpy(array)
        return data.pin_memory().to(self.device, non_blocking=True) if self.is_cuda else data

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """One host-to-device copy for all of a step's int arrays, each starting 16-byte aligned as
        a tensor of its own would: Triton compiles a kernel variant per pointer alignment, and a view
        aligned in one step but not the next would compile one in the middle of serving."""
        starts = np.cumsum([0] + [-(-a.size // 2) * 2 for a in arrays])     # two int64s: 16 bytes
        packed = np.zeros(starts[-1], np.int64)
        for a, start in zip(arrays, starts):
            packed[start:start + a.size] = a.ravel()
        data = self._host_to_device(packed)
        return [data[start:start + a.size].view(a.shape) for a, start in zip(arrays, starts)]
