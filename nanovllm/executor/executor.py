"""Rank 0's side of the device: start every rank's worker, launch a scheduled step on all of them,
collect its tokens.

The executor turns a ScheduledBatch into StepInputs (step_inputs.py), sends them to the other ranks'
processes (processes.py) and runs rank 0's worker, whose device samples one token for every sequence
whose prompt is fully computed (sampling_inputs.py); a verify step (speculative decoding) samples
every position of each sequence and keeps a prefix of its proposals (sample/rejection_sampler.py).
Under tensor parallelism every rank ends a sampled step holding its ids, for the next step to read:
each samples its vocabulary shard when no row needs every logit (sample/shard_sampler.py), or rank 0
samples the gathered logits and broadcasts the ids; rank 0 decides which, in the step's inputs.
Under pipeline stages rank 0 runs the first stage and returns; the last stage's logits come back
to it later: a step's sampling is queued at its launch to wait for them (on GPUs on a stream of its
own), or for a constrained step when it is collected (`sample`), so that rank 0 runs the next steps'
first stage meanwhile. Each step's ids stay on the device at a row offset of their own, for a
batch's next step to read before they reach the host (the first stage's other tensor-parallel
ranks get them from rank 0 when a step reads them: Worker.share_pending_tokens).
It holds the host's view of a step (its sequences); workers hold only tensors. It never decides
what runs; the scheduler does.
"""
import contextlib
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.core.step import ScheduledBatch, ShardSampling, StepInputs, pending_slot_offsets
from nanovllm.executor.processes import (LOADED, MULTICAST_OFF, WorkerCall, WorkerProcess, deferred_keyboard_interrupt,
                                         start_worker_processes, stop_worker_processes)
from nanovllm.executor.prompt_logprobs import (PromptLogprobRows, attach_prompt_logprobs, plan_prompt_logprobs,
                                               split_prompt_rows, with_prompt_rows)
from nanovllm.executor.ray_processes import RayRank, start_ray_workers, stop_ray_workers
from nanovllm.executor.sampling_inputs import build_sampling_tensors, build_shard_sampling, logprobs_by_row
from nanovllm.executor.pooling import pool_embeddings
from nanovllm.executor.step_inputs import build_step_inputs
from nanovllm.sample.sampler import SamplerOutput, SamplingTensors
from nanovllm.sample.rejection_sampler import rejection_sample
from nanovllm.executor.verify_inputs import build_verify_tensors, verify_rows
from nanovllm.worker.pipeline import IncomingLogits
from nanovllm.worker.worker import Worker, release_process_state


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: the sequences it samples, in row order, and host copies of its
    sampler output that are valid once `done` has passed. Launched without sampling, it holds its
    logits (or under pipeline stages, their receive) and sampling tensors until `Executor.sample`."""
    seqs: list[Sequence]
    scheduled: list[Sequence] = field(default_factory=list)   # every sequence it computes, sampled or not
    out: SamplerOutput | None = None
    done: torch.cuda.Event | None = None
    draft_lens: list[int] | None = None          # a verify step: proposals per sequence; out has a
    num_accepted: torch.Tensor | None = None     # row per position, and these were accepted
    logits: torch.Tensor | None = None
    incoming: IncomingLogits | None = None       # pipeline stages: the last stage's logits, on their way
    launched: torch.cuda.Event | None = None     # pipeline stages on GPUs: its sampling inputs are on the device
    sampling: SamplingTensors | None = None
    prompt_logprobs: PromptLogprobRows | None = None    # prompt positions whose logprobs it computes
    embeddings: torch.Tensor | None = None   # runner="pooling": each sequence's embedding, instead of a token
    row_offset: int = 0     # where its sampled ids are kept on the device (Worker.keep_token_ids)

    @property
    def observed_seqs(self) -> list[Sequence]:
        """The sequences waiting for something of this step: those it samples, and those whose
        prompt logprobs it computes."""
        return self.seqs + (self.prompt_logprobs.seqs if self.prompt_logprobs is not None else [])

    @property
    def sampled(self) -> bool:
        """Is its sampling queued? Not for a step launched without it, nor under pipeline stages
        before its logits are in."""
        return self.logits is None and self.incoming is None


def leave_process_group(clean: bool) -> None:
    """Leave the group this engine's rank 0 joined (an engine runs alone in its process: the group is
    its own). `clean`: every rank left too; else do not wait for them (a plain destroy can hang on NCCL)."""
    if not dist.is_initialized():
        # a failed init_process_group still counted its group (pytorch#46561): the next group here
        # would take another name than fresh ranks give theirs, and wait for them until its timeout
        dist.distributed_c10d._world.group_count = 0
    elif clean:
        dist.destroy_process_group()
    else:
        try:
            dist.distributed_c10d._abort_process_group()
        except (AttributeError, RuntimeError):
            dist.destroy_process_group()


class Executor:
    """Rank 0's worker in this process, the others in worker processes (processes.py) or Ray actors
    (ray_processes.py, distributed_executor_backend="ray"): handles of the same interface."""

    def __init__(self, config: Config, multi_token_len: int | None = None):
        self.config = config
        self.processes: list[WorkerProcess | RayRank] = []
        self.ranks_apart = False      # ranks went out of step (see _step_everywhere)
        self.ids_awaited = False      # the other ranks wait for the ids of a step launched unsampled
        self.incoming: deque[IncomingLogits] = deque()   # pipeline stages: posted receives, oldest first
        self.sample_stream: torch.cuda.Stream | None = None     # pipeline stages on GPUs: see _on_sample_stream
        self.num_launched = 0
        self.sampled_events: dict[int, torch.cuda.Event] = {}    # on the sample stream: row offset -> ids written
        rendezvous = None
        if config.world_size > 1:     # tensor-parallel ranks and pipeline stages
            if dist.is_initialized():
                raise RuntimeError("tensor_parallel_size x pipeline_parallel_size > 1 needs torch.distributed's "
                                   "default process group, which is already initialized in this process (another "
                                   "multi-rank engine still open?): close it first")
            os.environ.update(MULTICAST_OFF)
            start, stop = (start_ray_workers, stop_ray_workers) if config.distributed_executor_backend == "ray" \
                else (start_worker_processes, stop_worker_processes)
            rendezvous, self.processes = start(config, multi_token_len)
            self._stop_processes = weakref.finalize(self, stop, self.processes)
        driver = None
        try:
            # rank 0 forms the group on the store the other ranks connect to
            self.driver = driver = Worker(config, 0, rendezvous, multi_token_len)
            for process in self.processes:   # before the first collective, which would hang on a dead rank
                process.expect(LOADED)
            self.driver.init_kv_cache()
        except BaseException:
            self.ranks_apart = True     # the other ranks may wait in a collective: kill them, do not wait
            self._shut_down(driver)
            raise
        if self.driver.is_cuda and config.pipeline_parallel_size > 1:
            self.sample_stream = torch.cuda.Stream(self.driver.device)
        self.unseeded = np.random.default_rng()

    @property
    def needs_restart(self) -> bool:
        """Must the engine start the ranks anew? When they went out of step, or wait in a broadcast
        for the ids of a step whose sampling never ran (an error between launch and sample)."""
        return self.ranks_apart or self.ids_awaited

    @property
    def num_kvcache_blocks(self) -> int:
        return self.driver.num_kvcache_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.driver.host_kv_cache.num_blocks if self.driver.host_kv_cache else 0

    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        """Run a Worker method on every rank (rank 0 here, the others in their processes, all at
        once, so a method holding a collective meets); the results in rank order."""
        with deferred_keyboard_interrupt():
            call = WorkerCall(method, args, kwargs)
            for process in self.processes:
                process.send(call)
            try:
                mine = getattr(self.driver, method)(*args, **kwargs)
            except BaseException:
                self.ranks_apart = bool(self.processes)     # the others may wait in a collective
                raise
            answers = [process.answer() for process in self.processes]     # every one, so none is stale
            for process, (status, value) in zip(self.processes, answers):
                if status != "ok":
                    raise RuntimeError(f"{method} failed on worker {process.rank}:\n{value}")
            return [mine] + [value for _, value in answers]

    # ---- one step ------------------------------------------------------------------------------

    def prepare_step(self, batch: ScheduledBatch) -> StepInputs:
        inputs = build_step_inputs(batch, self.config.kvcache_block_size)
        if batch.kv_offloads or batch.kv_loads:
            inputs.kv_offloads = np.array(batch.kv_offloads, dtype=np.int64).reshape(-1, 2)
            inputs.kv_loads = np.array(batch.kv_loads, dtype=np.int64).reshape(-1, 2)
        return inputs

    def prepare_sampling(self, seqs: list[Sequence], offsets: list[int] | None = None) -> SamplingTensors:
        return build_sampling_tensors(seqs, self.config.model_config.vocab_size, self.config.eos_token_ids,
                                      self.unseeded, self.driver.host_to_device, offsets)

    def prepare_shard_sampling(self, seqs: list[Sequence]) -> ShardSampling | None:
        return build_shard_sampling(seqs, self.unseeded)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, sample: bool = True) -> LaunchedStep:
        """Queue one scheduled step (model and, unless `sample` is False, sampling) on the device and
        return without waiting, so the host can prepare the next step while this one runs. Under
        pipeline stages a step is sampled only once its logits are in (`sample`)."""
        inputs = self.prepare_step(batch)
        prompt_rows = plan_prompt_logprobs(batch, inputs)     # None unless a sequence asks
        if prompt_rows is not None:
            inputs.logits_indices = with_prompt_rows(inputs.logits_indices, prompt_rows)
        seqs = batch.sampled_seqs()
        step = LaunchedStep(seqs, batch.seqs, prompt_logprobs=prompt_rows, row_offset=self._next_row_offset())
        if self.sample_stream is not None:
            self._wait_for_pending_tokens(inputs)
        if self.driver.shares_tokens and seqs and batch.draft_token_ids is None and not self.driver.pooling:
            # every rank gets the sampled ids: sampled on the shards when no row needs every logit
            if sample and prompt_rows is None:
                inputs.shard_sampling = self.prepare_shard_sampling(seqs)
            if inputs.shard_sampling is None:
                inputs.num_shared_tokens = len(seqs)
                self.ids_awaited = not sample
        with self._step_everywhere(inputs):
            if inputs.shard_sampling is not None:
                self._to_host(step, SamplerOutput(self._watching_ranks(self.driver.run, inputs)))
                return step
            logits = self._watching_ranks(self.driver.run, inputs)
            if isinstance(logits, IncomingLogits):     # pipeline stages: the last stage sends them later
                step.incoming = logits
                self.incoming.append(logits)
                step.sampling = self.prepare_sampling(seqs) if seqs else None
                if self.sample_stream is not None:
                    step.launched = torch.cuda.Event()
                    step.launched.record()
                if sample:      # queued now, it waits for the logits (on the CPU the host does)
                    self.sample(step)
                return step
            if prompt_rows is not None:
                logits = split_prompt_rows(prompt_rows, logits, self.driver.host_to_device)
            if not seqs:
                return step
            if self.driver.pooling:     # the rows are the final hidden states of each prompt's last token
                step.embeddings = pool_embeddings(logits).to("cpu", non_blocking=True)
                step.done = torch.cuda.Event() if self.driver.is_cuda else None
                if step.done is not None:
                    step.done.record()
                return step
            if batch.draft_token_ids is not None:     # a verify step samples at once (never constrained)
                out, num_accepted = self._verify(logits, seqs, batch.draft_token_ids)
                step.draft_lens = list(map(len, batch.draft_token_ids))
                step.num_accepted = num_accepted.to("cpu", non_blocking=True)
                self._to_host(step, out)
                return step
            step.logits, step.sampling = logits, self.prepare_sampling(seqs)
            if sample:
                self._sample(step)
            return step

    def _next_row_offset(self) -> int:
        """Where the next step's sampled ids are kept on the device: under pipeline stages a slot of
        max_num_seqs rows per step that can be in flight, in turn (Worker.keep_token_ids)."""
        slot = self.num_launched % self.driver.num_token_slots
        self.num_launched += 1
        return slot * self.config.max_num_seqs

    def _wait_for_pending_tokens(self, inputs: StepInputs) -> None:
        """Under pipeline stages on GPUs rank 0 samples on its sample stream: the step's first stage
        (the default stream) waits for the sampling of each step whose ids it reads."""
        for offset in pending_slot_offsets(inputs.input_ids, self.config.max_num_seqs):
            torch.cuda.current_stream(self.driver.device).wait_event(self.sampled_events[offset])

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence],
                drafts: list[list[int]]) -> tuple[SamplerOutput, torch.Tensor]:
        """Rejection-sample a verify step's rows (sample/rejection_sampler.py)."""
        row_seqs, positions = verify_rows(seqs, drafts)
        verify = build_verify_tensors(drafts, positions, self.driver.host_to_device)
        return rejection_sample(logits, self.prepare_sampling(row_seqs, positions), verify)

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, token_bitmask=None) -> None:
        """Queue the sampling of a step launched without it, under the grammars' token bitmask
        (TokenBitmask) if any; under tensor parallelism this ends the step on every rank. Under
        pipeline stages, first wait for its logits from the last stage (and queue its prompt logprobs)."""
        with self._step_everywhere(), self._on_sample_stream(step):
            if step.incoming is not None:
                step.logits = self._watching_ranks(self._receive, step.incoming)
                step.incoming = None
                if step.prompt_logprobs is not None:
                    step.logits = split_prompt_rows(step.prompt_logprobs, step.logits, self.driver.host_to_device)
            if step.seqs:
                self._watching_ranks(self._sample, step, token_bitmask)
            else:                 # a step of prompt logprobs only
                step.logits = None
            self.ids_awaited = False

    @contextlib.contextmanager
    def _on_sample_stream(self, step: LaunchedStep):
        """Under pipeline stages on GPUs rank 0 samples a step on a stream of its own, which waits
        for the step's launch and its logits only: on the default stream the sampling would queue
        behind the first stage of every step launched since, and the host would learn the tokens
        (and schedule those sequences again) a stage's compute later. What it reads, allocated on
        the default stream, is marked as used by this one, so that memory is not reused before."""
        if step.launched is None:
            yield
            return
        self.sample_stream.wait_event(step.launched)
        used = [step.incoming.logits] if step.incoming is not None else []
        if step.sampling is not None:
            used += [getattr(step.sampling, f.name) for f in fields(step.sampling)]
        for tensor in used:
            if isinstance(tensor, torch.Tensor):
                tensor.record_stream(self.sample_stream)
        step.launched = None
        with torch.cuda.stream(self.sample_stream):
            yield

    def _receive(self, incoming: IncomingLogits) -> torch.Tensor:
        """Wait for a step's logits (a constrained step's may be waited for after those of later
        steps: messages between two ranks keep their order, whichever receive is waited for first).
        The receives of steps nobody collects (dropped when their requests were aborted) stay
        listed, their buffers alive, until they complete."""
        logits = incoming.wait()
        self.incoming = deque(posted for posted in self.incoming if posted is not incoming and not posted.completed)
        return logits

    def discard_in_flight(self) -> None:
        """Forget the steps in flight (a recovery): wait for the logits the last stage still sends
        rank 0 for them, so that every stage has finished them and no receive is left half done. If
        that fails, or the ranks went apart anyway, they start anew (needs_restart); with a rank
        dead (an error that names it was raised), nothing is waited for."""
        pending, self.incoming = self.incoming, deque()
        if not pending or self.needs_restart:
            return
        with deferred_keyboard_interrupt():
            try:
                self._check_ranks_alive()
            except RuntimeError:
                return
            try:
                for incoming in pending:
                    self._watching_ranks(incoming.wait)
            except Exception:
                self.ranks_apart = True

    def _watching_ranks(self, call, *args):
        """call(*args), a share of a step that meets the other ranks. On the CPU it runs in a thread
        while this one watches them: a gloo send to a rank that has just died can miss the closed
        connection and wait out the process group's timeout (10 minutes; seen about once in 90
        kills), so a dead rank is raised from here, naming it. On GPUs NCCL queues the work and
        _wait_for_device watches the ranks."""
        if self.driver.is_cuda or not self.processes:
            return call(*args)
        outcome = []

        def run():
            try:
                outcome.append((True, call(*args)))
            except BaseException as error:
                outcome.append((False, error))

        # a daemon: one stuck in gloo must not keep the interpreter from exiting
        thread = threading.Thread(target=run, name="nanovllm-rank0-step", daemon=True)
        thread.start()
        thread.join(timeout=0.05)
        while thread.is_alive():
            self._check_ranks_alive()
            thread.join(timeout=0.05)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _sample(self, step: LaunchedStep, token_bitmask=None) -> None:
        if token_bitmask is not None:
            step.sampling.token_bitmask, step.sampling.bitmask_rows = token_bitmask.to(self.driver.device)
        out = self.driver.sample(step.logits, step.sampling, step.row_offset)
        step.logits = step.sampling = None
        self._to_host(step, out)
        if self.sample_stream is not None:
            self.sampled_events[step.row_offset] = step.done

    def _to_host(self, step: LaunchedStep, out: SamplerOutput) -> None:
        """Start copying a step's sampled tokens to the host; `step.done` marks when they are there."""
        to_host = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        step.out = SamplerOutput(to_host(out.token_ids), to_host(out.logprobs), to_host(out.top_logprobs),
                                 to_host(out.top_token_ids))
        step.done = torch.cuda.Event() if self.driver.is_cuda else None
        if step.done is not None:
            step.done.record()

    @contextlib.contextmanager
    def _step_everywhere(self, inputs: StepInputs | None = None):
        """Send a step to the worker processes (None: continue one they have, or under pipeline
        stages receive its logits) and run rank 0's share in the block. A Ctrl-C waits until the
        block ends (the ranks must meet in every collective); any other failure once the processes
        have the step leaves the ranks apart, so the engine must start them anew (needs_restart)."""
        if not self.processes:
            yield
            return
        with deferred_keyboard_interrupt():
            if inputs is not None:
                for process in self.processes:
                    process.send(inputs)
            try:
                yield
            except BaseException:
                for process in self.processes:   # a collective failing because a rank died says so
                    process.join(timeout=1)
                    process.check_alive()
                self.ranks_apart = True
                raise

    def collect(self, step: LaunchedStep) -> tuple[list[int], list[dict[int, float] | None]]:
        """Wait for a launched step; the token (and logprobs, where asked) of each sampled sequence.
        Prompt logprobs it computed are written into their sequences first."""
        if step.prompt_logprobs is not None:
            attach_prompt_logprobs(step.prompt_logprobs)
        if not step.seqs:
            return [], []
        self._wait_for_device(step.done)
        return step.out.token_ids.tolist(), logprobs_by_row(step.out, step.seqs)

    def collect_embeddings(self, step: LaunchedStep) -> list[list[float]]:
        """Wait for a pooling step; the embedding of each sequence whose prefill it finished."""
        self._wait_for_device(step.done)
        return step.embeddings.tolist()

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

    def _wait_for_device(self, done: torch.cuda.Event | None) -> None:
        """With worker processes on GPUs, a dead rank would leave a step hanging in NCCL: wait by polling."""
        if done is None:
            return
        if not self.processes:
            done.synchronize()
            return
        while not done.query():
            self._check_ranks_alive()
            time.sleep(0.0001)

    def _check_ranks_alive(self) -> None:
        """A RuntimeError naming the first rank whose process or actor has died."""
        for process in self.processes:
            process.check_alive()

    def close(self) -> None:
        """Stop the worker processes, free rank 0's device memory and leave the process group."""
        self._shut_down(self.driver)

    def _shut_down(self, driver: Worker | None) -> None:
        """close(), also for a start that failed part way, before rank 0's worker was built or after:
        nothing is left behind, so that the next engine in this process can start."""
        if self.processes:
            if self.needs_restart:     # the processes wait in a collective rank 0 left: do not wait for them
                for process in self.processes:
                    process.kill()
            self._stop_processes()
        clean = all(process.exited_cleanly for process in self.processes)
        if driver is not None:
            driver.close()
        else:
            release_process_state()
        if self.config.world_size > 1:
            leave_process_group(clean)
