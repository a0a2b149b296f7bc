"""One rank of the engine: its shard of the model, its KV cache and its CUDA graphs.

A worker runs the model on a step's flat inputs (StepInputs: core/step.py), eagerly or by replaying
a CUDA graph for decode (cuda_graph.py), over the paged pool (kv_cache.py), and samples the rows it
is given (under tensor parallelism every rank ends a step holding the sampled ids: `run`). It knows
nothing of sequences or scheduling: the executor (executor/executor.py) turns scheduled batches
into inputs, drives every rank's worker, and reads the tokens back. Start-up is in
two halves so that an executor can check every rank loaded its weights before the first collective
(sizing the KV pool): `Worker(...)` loads the model, `init_kv_cache()` sizes, allocates and warms up.

Under pipeline parallelism a worker holds one stage's layers (and their KV cache); a step receives
the previous stage's hidden states and sends its own on (pipeline.py), and each rank runs the steps
in the order they come, several of them in flight at once. Each stage replays its own decode graphs;
the send and receive run between them.
"""
import contextlib
import math
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.attention import choose_attention_backend, use_metadata
from nanovllm.config import Config
from nanovllm.core.step import SPECULATION_MAX_RUNNING, ShardSampling, StepInputs, pending_slot_offsets
from nanovllm.kernels.fp8_kv_cache import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from nanovllm.layers.all_reduce import start_one_shot_all_reduce, stop_one_shot_all_reduce
from nanovllm.layers.attention import Attention
from nanovllm.layers.parallel_state import init_parallel_state, reset_parallel_state
from nanovllm.sample.sampler import Sampler, SamplerOutput, SamplingTensors
from nanovllm.sample.shard_sampler import sample_shard
from nanovllm.models.registry import build_model
from nanovllm.worker.weight_loader import load_model, weight_bytes
from nanovllm.worker.cuda_graph import StepGraphs
from nanovllm.worker.kv_cache import KVCache, cpu_budget_bytes
from nanovllm.worker.kv_offload import HostKVCache
from nanovllm.worker.pipeline import (IncomingLogits, post_logits_receive, receive_activations, send_activations,
                                      send_logits)
from nanovllm.worker.rollout import WorkerRollout


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


GROUP_TIMEOUT = timedelta(minutes=10)     # for the ranks to meet, and for a collective to finish


def release_process_state() -> None:
    """Forget what a rank sets for its whole process (the parallel state, the one-shot all-reduce):
    at close, and when its start failed part way, so that the next engine here starts from none."""
    reset_parallel_state()
    stop_one_shot_all_reduce()


class Worker(WorkerRollout):
    """One rank: rank 0 lives in the engine's process, the others in processes an executor starts.
    Rollout control (in-place weight updates, sleep and wake up) is WorkerRollout's (rollout.py)."""

    def __init__(self, config: Config, rank: int = 0, rendezvous: dist.Store | None = None,
                 multi_token_len: int | None = None):
        self.config = config
        self.rank = rank
        self.tp_size = config.tensor_parallel_size
        self.world_size = config.world_size     # tensor-parallel size x pipeline stages
        self.block_size = config.kvcache_block_size
        self.multi_token_len = multi_token_len
        if config.device == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())   # a Ray actor sees one GPU
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.graphs: list[StepGraphs] = []     # captured last, once the pool exists
        if self.world_size > 1:
            if not self.is_cuda:   # ranks share the cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world_size))
            dist.init_process_group("nccl" if self.is_cuda else "gloo", store=rendezvous,
                                    world_size=self.world_size, rank=rank, timeout=GROUP_TIMEOUT)
        # before the model is built (every rank, one too): its layers take their shard and group from it
        self.parallel = init_parallel_state(rank, self.tp_size, config.pipeline_parallel_size)
        if self.tp_size > 1 and not config.disable_custom_all_reduce:
            start_one_shot_all_reduce(self.parallel.tp_group, self.device, config.torch_dtype)
        with torch.device(self.device), default_dtype(config.torch_dtype):
            self.model = build_model(config.model_config)
        self.pooling = config.runner == "pooling"      # returns hidden states: no LM head, no sampling
        if self.pooling:
            self.model.lm_head = None
        self.checkpoint_kv_scales = load_model(self.model, config)
        self.model.eval()
        self.weight_bytes = weight_bytes(self.model)   # this rank's
        self.sampler = Sampler()
        self.last_token_ids: torch.Tensor | None = None   # the sampled ids the next steps read (keep_token_ids)
        # under pipeline stages the first stage keeps the ids of each step in flight (and of the next), in rows of their own
        self.num_token_slots = config.pipeline_parallel_size + 1 if config.pipeline_parallel_size > 1 else 1
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        kv_dtype = FP8_DTYPE if config.kv_cache_dtype == "fp8" else config.torch_dtype
        self.backend = choose_attention_backend(self.device, self.attention_layers[0].num_kv_heads, kv_dtype)
        for attn in self.attention_layers:
            attn.backend = self.backend
        self.kv_cache = KVCache(self.attention_layers, self.block_size, kv_dtype, self.device)
        self.host_kv_cache: HostKVCache | None = None
        self.num_kvcache_blocks = 0

    def init_kv_cache(self) -> None:
        """Size the KV pool (a collective under TP: every rank takes the smallest), calibrate float8
        scales, allocate, compile the cached-prefill path and capture the decode graphs."""
        config = self.config
        self.host_kv_cache = self._allocate_host_tier()      # before sizing: its staging takes device memory
        self.num_kvcache_blocks = self._size_kv_cache()
        if self.kv_cache.is_fp8 and not self._use_checkpoint_kv_scales(self.checkpoint_kv_scales):
            self._calibrate_kv_scales()
        self.kv_cache.allocate(self.num_kvcache_blocks)
        if self.is_cuda:
            self._run_cached_prefill()
        if self.is_cuda and not config.enforce_eager and not self.pooling:     # pooling never decodes
            self._capture_graphs(self.multi_token_len)

    def _capture_graphs(self, multi_token_len: int | None) -> None:
        """Decode graphs, and with speculation graphs of verify steps (k + 1 tokens per sequence) for
        the batches that speculate."""
        config = self.config
        if multi_token_len is None:
            spec = config.speculative_config
            multi_token_len = spec.num_speculative_tokens + 1 if spec is not None else 1
        shape = (config.min_kvcache_blocks, config.model_config.hidden_size, config.torch_dtype, self.device)
        stage = self.parallel
        decode = StepGraphs(self.model, self.backend, config.max_num_seqs, *shape, num_stages=stage.num_stages,
                            first_stage=stage.is_first_stage, last_stage=stage.is_last_stage)
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
        if self.pooling:
            torch.cuda.synchronize(self.device)
            return
        # the largest decode batch's logits and sampling
        hidden = torch.zeros(config.max_num_seqs, config.model_config.hidden_size, device=self.device)
        rows = config.max_num_seqs
        if self.parallel.is_last_stage:
            logits = self.model.compute_logits(hidden.to(config.torch_dtype))
        else:    # rank 0 of a pipeline samples the last stage's logits
            logits = torch.zeros(rows, config.model_config.vocab_size, dtype=config.torch_dtype, device=self.device)
        if self.rank == 0:     # under grammars' masks (allowing all): compiles that kernel, counts its logits copy
            int32 = dict(dtype=torch.int32, device=self.device)
            self.sampler(logits, SamplingTensors(torch.ones(rows, device=self.device),
                                                 torch.zeros(rows, dtype=torch.int64, device=self.device),
                                                 token_bitmask=torch.full((rows, -(-logits.shape[1] // 32)), -1, **int32),
                                                 bitmask_rows=torch.arange(rows, **int32)))
        if self.shares_tokens:    # every rank: compiles the shard sampler's kernel (meets in its all-gather)
            self.sample_shard(self.model.compute_logits(hidden.to(config.torch_dtype), gather=False),
                              ShardSampling(np.ones(rows, np.float32), np.zeros(rows, np.int64)))
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
        num_layers, first = len(self.attention_layers), self.model.start_layer    # this stage's layers
        if any(set(scales.get(first + i, ())) != {"k", "v"} for i in range(num_layers)):
            return False
        for i in range(num_layers):
            for row, which in enumerate("kv"):
                value = float(scales[first + i][which].max())
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"model: checkpoint {which}_scale of layer {first + i} is {value}; it must be positive")
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

    @property
    def shares_tokens(self) -> bool:
        """Do the other ranks need this rank's sampled ids? Under tensor parallelism on one stage
        every rank reads the pending tokens of the next step from its own device."""
        return self.tp_size > 1 and self.parallel.num_stages == 1

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingTensors, row_offset: int = 0) -> SamplerOutput:
        """Sample the rows of a step's logits (rank 0); the next step reads its pending tokens from
        the result, on every rank: a tensor-parallel group gets them by broadcast (Worker.run).
        `row_offset`: where they go among the sampled ids kept (keep_token_ids)."""
        out = self.sampler(logits, sampling)
        if self.shares_tokens:
            dist.broadcast(out.token_ids, src=0, group=self.parallel.tp_group)
        self.keep_token_ids(out.token_ids, row_offset)
        return out

    def keep_token_ids(self, token_ids: torch.Tensor, row_offset: int) -> None:
        """Keep a step's sampled ids for the steps that read them as pending tokens: the last step's
        alone, or under pipeline stages each step's from its own row offset (a slot of max_num_seqs
        rows per step that can be in flight, Executor.launch), since a batch's next step reads the
        ids of the step launched P steps before it."""
        if self.num_token_slots == 1:
            self.last_token_ids = token_ids
            return
        self._token_slots()[row_offset:row_offset + len(token_ids)].copy_(token_ids)

    def _token_slots(self) -> torch.Tensor:
        if self.last_token_ids is None:
            self.last_token_ids = torch.zeros(self.num_token_slots * self.config.max_num_seqs, dtype=torch.int64,
                                              device=self.device)
        return self.last_token_ids

    def share_pending_tokens(self, input_ids: np.ndarray) -> None:
        """Under pipeline stages rank 0 alone samples: the first stage's other tensor-parallel ranks,
        which embed the step's ids too, get the slots its pending tokens are in from it (the
        executor has made rank 0's stream wait until they are sampled)."""
        rows = self.config.max_num_seqs
        for offset in pending_slot_offsets(input_ids, rows):
            dist.broadcast(self._token_slots()[offset:offset + rows], src=0, group=self.parallel.tp_group)

    @torch.inference_mode()
    def sample_shard(self, logits: torch.Tensor, sampling: ShardSampling) -> torch.Tensor:
        """Every tensor-parallel rank samples its own shard of the vocabulary and gets the same ids."""
        head = self.model.lm_head
        temperatures, seeds = self.host_to_device(sampling.temperatures), self.host_to_device(sampling.seeds)
        self.last_token_ids = sample_shard(logits, temperatures, seeds, sampling.all_greedy, head.vocab_start,
                                           head.num_embeddings, self.parallel.tp_group)
        return self.last_token_ids

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | IncomingLogits | None:
        """A step as every rank runs it: the model, then this rank's part of the sampling. With
        `inputs.shard_sampling`, the sampled ids; otherwise what `execute` returns (rank 0 then
        samples, broadcasting the ids to the others, who wait for them here). On rank 0 of a
        pipeline, the last stage's logits still on their way (they come with the step's collection)."""
        logits = self.execute(inputs, logits_later=True)
        if inputs.shard_sampling is not None:
            return self.sample_shard(logits, inputs.shard_sampling)
        if inputs.num_shared_tokens and self.rank != 0:
            self.last_token_ids = torch.empty(inputs.num_shared_tokens, dtype=torch.int64, device=self.device)
            dist.broadcast(self.last_token_ids, src=0, group=self.parallel.tp_group)
        return logits

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, logits_later: bool = False) -> torch.Tensor | IncomingLogits | None:
        """Run the model on one step's inputs; logits of the sampled rows (on rank 0, or each rank's
        vocabulary shard for `inputs.shard_sampling`), or under runner="pooling" their final hidden
        states. `logits_later`: on rank 0 of a pipeline, return once this stage has sent the step
        on, with the receive of the last stage's logits posted (IncomingLogits), not waited for."""
        if len(inputs.kv_offloads) or len(inputs.kv_loads):    # the prefix cache's host tier
            self.host_kv_cache.transfer(inputs.kv_offloads, inputs.kv_loads)
        if len(inputs.block_copies):    # copy-on-write of blocks shared by forked sequences
            self.kv_cache.copy_blocks(self.host_to_device(inputs.block_copies))
        if self.parallel.num_stages > 1 and self.parallel.is_first_stage and self.tp_size > 1:
            self.share_pending_tokens(inputs.input_ids)
        graphs, size = next(((graphs, size) for graphs in self.graphs if (size := graphs.size_for(inputs))),
                            (None, 0))
        intermediate = None if self.parallel.is_first_stage else receive_activations(
            len(inputs.input_ids), self.config.model_config.hidden_size, self.config.torch_dtype, self.device,
            self.rank - self.tp_size)
        if graphs is not None:
            # only the first stage embeds the ids (and holds the sampled ones)
            hidden, rows = graphs.replay(inputs, size, self.read_pending_tokens if intermediate is None else None,
                                         intermediate)
        else:
            input_ids, positions, slot_mapping, context_lens, cu_seqlens_q, block_tables = self._to_device(
                inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.context_lens,
                inputs.cu_seqlens_q, inputs.block_tables)
            if intermediate is None and inputs.input_ids.min() < 0:
                input_ids = self.read_pending_tokens(input_ids)
            metadata = self.backend.metadata(inputs.is_prefill, slot_mapping, context_lens, block_tables,
                                             cu_seqlens_q, inputs.context_lens, inputs.cu_seqlens_q)
            with use_metadata(metadata):
                hidden = self.model(input_ids, positions, intermediate)
            rows = inputs.logits_indices
        if not self.parallel.is_last_stage:
            send_activations(*hidden, self.rank + self.tp_size)
            if self.rank != 0:
                return None
            # after the send: with two stages both go between the same two ranks, which must agree on the order
            incoming = self._logits_from_last_stage(len(rows))
            return incoming if logits_later else incoming.wait()
        if len(rows) != len(hidden):
            hidden = hidden[self.host_to_device(rows)]
        if self.pooling:
            return hidden
        logits = self.model.compute_logits(hidden, gather=inputs.shard_sampling is None)
        if self.parallel.num_stages > 1 and self.parallel.tp_rank == 0 and len(rows):
            send_logits(logits, 0)
        return logits

    def _logits_from_last_stage(self, num_rows: int) -> IncomingLogits:
        return post_logits_receive(num_rows, self.config.model_config.vocab_size, self.config.torch_dtype,
                                   self.device, self.parallel.global_rank(self.parallel.num_stages - 1, 0))

    def close(self) -> None:
        """Free this rank's device memory (the executor leaves the process group)."""
        self.graphs, self.model, self.last_token_ids = [], None, None
        release_process_state()
        self.kv_cache.release()
        if self.host_kv_cache is not None:
            self.host_kv_cache.release()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def read_pending_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Ids -1 - row stand for sampled tokens still only on the device (keep_token_ids)."""
        rows = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.last_token_ids[rows], input_ids)

    def host_to_device(self, array: np.ndarray) -> torch.Tensor:
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
        data = self.host_to_device(packed)
        return [data[start:start + a.size].view(a.shape) for a, start in zip(arrays, starts)]
