"""Rank 0's side of the device: start every rank's worker, launch a scheduled step on all of them,
collect its tokens.

The executor turns a ScheduledBatch into StepInputs (step_inputs.py), sends them to the other ranks'
processes (processes.py) and runs rank 0's worker, whose device samples one token for every sequence
whose prompt is fully computed (sampling_inputs.py); a verify step (speculative decoding) samples
every position of each sequence and keeps a prefix of its proposals (sample/rejection_sampler.py).
It holds the host's view of a step (its sequences); workers hold only tensors. It never decides
what runs; the scheduler does.
"""
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.core.step import ScheduledBatch, StepInputs
from nanovllm.executor.processes import (LOADED, MULTICAST_OFF, WorkerCall, WorkerProcess, deferred_keyboard_interrupt,
                                         start_worker_processes, stop_worker_processes)
from nanovllm.executor.prompt_logprobs import (PromptLogprobRows, attach_prompt_logprobs,
                                               compute_prompt_logprobs, plan_prompt_logprobs,
                                               with_prompt_rows)
from nanovllm.executor.ray_processes import RayRank, start_ray_workers, stop_ray_workers
from nanovllm.executor.sampling_inputs import build_sampling_tensors, logprobs_by_row
from nanovllm.executor.pooling import pool_embeddings
from nanovllm.executor.step_inputs import build_step_inputs
from nanovllm.sample.sampler import SamplerOutput, SamplingTensors
from nanovllm.sample.rejection_sampler import rejection_sample
from nanovllm.executor.verify_inputs import build_verify_tensors, verify_rows
from nanovllm.worker.worker import Worker


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: the sequences it samples, in row order, and host copies of its
    sampler output that are valid once `done` has passed. Launched without sampling, it holds its
    logits and sampling tensors until `Executor.sample` (token masks come later)."""
    seqs: list[Sequence]
    out: SamplerOutput | None = None
    done: torch.cuda.Event | None = None
    draft_lens: list[int] | None = None          # a verify step: proposals per sequence; out has a
    num_accepted: torch.Tensor | None = None     # row per position, and these were accepted
    logits: torch.Tensor | None = None
    sampling: SamplingTensors | None = None
    prompt_logprobs: PromptLogprobRows | None = None    # prompt positions whose logprobs it computes
    embeddings: torch.Tensor | None = None   # runner="pooling": each sequence's embedding, instead of a token

    @property
    def observed_seqs(self) -> list[Sequence]:
        """The sequences waiting for something of this step: those it samples, and those whose
        prompt logprobs it computes."""
        return self.seqs + (self.prompt_logprobs.seqs if self.prompt_logprobs is not None else [])


class Executor:
    """Rank 0's worker in this process, the others in worker processes (processes.py) or Ray actors
    (ray_processes.py, distributed_executor_backend="ray"): handles of the same interface."""

    def __init__(self, config: Config, multi_token_len: int | None = None):
        self.config = config
        self.processes: list[WorkerProcess | RayRank] = []
        self.needs_restart = False    # ranks went out of step (see _execute_everywhere)
        init_method = None
        if config.world_size > 1:     # tensor-parallel ranks and pipeline stages
            os.environ.update(MULTICAST_OFF)
            start, stop = (start_ray_workers, stop_ray_workers) if config.distributed_executor_backend == "ray" \
                else (start_worker_processes, stop_worker_processes)
            init_method, self.processes = start(config, multi_token_len)
            self._stop_processes = weakref.finalize(self, stop, self.processes)
        self.driver = Worker(config, 0, init_method, multi_token_len)
        for process in self.processes:   # before the first collective, which would hang on a dead rank
            process.expect(LOADED)
        self.driver.init_kv_cache()
        self.unseeded = np.random.default_rng()

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
                self.needs_restart = bool(self.processes)     # the others may wait in a collective
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

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, sample: bool = True) -> LaunchedStep:
        """Queue one scheduled step (model and, unless `sample` is False, sampling) on the device and
        return without waiting, so the host can prepare the next step while this one runs."""
        inputs = self.prepare_step(batch)
        prompt_rows = plan_prompt_logprobs(batch, inputs)     # None unless a sequence asks
        if prompt_rows is not None:
            sampled_rows, inputs.logits_indices = with_prompt_rows(inputs.logits_indices, prompt_rows)
        logits = self._execute_everywhere(inputs) if self.processes else self.driver.execute(inputs)
        if prompt_rows is not None:
            to_device = self.driver.host_to_device
            compute_prompt_logprobs(prompt_rows, logits[to_device(prompt_rows.logits_rows)], to_device)
            logits = logits[to_device(sampled_rows)]
        seqs = batch.sampled_seqs()
        if not seqs:
            return LaunchedStep(seqs, prompt_logprobs=prompt_rows)
        if self.driver.pooling:     # the rows are the final hidden states of each prompt's last token
            step = LaunchedStep(seqs, embeddings=pool_embeddings(logits).to("cpu", non_blocking=True))
            step.done = torch.cuda.Event() if self.driver.is_cuda else None
            if step.done is not None:
                step.done.record()
            return step
        if batch.draft_token_ids is not None:     # a verify step samples at once (never constrained)
            out, num_accepted = self._verify(logits, seqs, batch.draft_token_ids)
            step = LaunchedStep(seqs, draft_lens=list(map(len, batch.draft_token_ids)))
            step.num_accepted = num_accepted.to("cpu", non_blocking=True)
            self._to_host(step, out)
            return step
        step = LaunchedStep(seqs, logits=logits, sampling=self.prepare_sampling(seqs), prompt_logprobs=prompt_rows)
        if sample:
            self.sample(step)
        return step

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence],
                drafts: list[list[int]]) -> tuple[SamplerOutput, torch.Tensor]:
        """Rejection-sample a verify step's rows (sample/rejection_sampler.py)."""
        row_seqs, positions = verify_rows(seqs, drafts)
        verify = build_verify_tensors(drafts, positions, self.driver.host_to_device)
        return rejection_sample(logits, self.prepare_sampling(row_seqs, positions), verify)

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, token_bitmask=None) -> None:
        """Queue a launched step's sampling, under the grammars' token bitmask (TokenBitmask) if any."""
        if token_bitmask is not None:
            step.sampling.token_bitmask, step.sampling.bitmask_rows = token_bitmask.to(self.driver.device)
        out = self.driver.sample(step.logits, step.sampling)
        step.logits = step.sampling = None
        self._to_host(step, out)

    def _to_host(self, step: LaunchedStep, out: SamplerOutput) -> None:
        """Start copying a step's sampled tokens to the host; `step.done` marks when they are there."""
        to_host = lambda t: None if t is None else t.to("cpu", non_blocking=True)  # noqa: E731
        step.out = SamplerOutput(to_host(out.token_ids), to_host(out.logprobs), to_host(out.top_logprobs),
                                 to_host(out.top_token_ids))
        step.done = torch.cuda.Event() if self.driver.is_cuda else None
        if step.done is not None:
            step.done.record()

    def _execute_everywhere(self, inputs: StepInputs) -> torch.Tensor | None:
        """Send a step to the worker processes and run rank 0's share. A Ctrl-C waits until the step
        is done (the ranks must meet in every collective); any other failure once the processes have
        the step leaves the ranks apart, so the engine must start them anew (needs_restart)."""
        with deferred_keyboard_interrupt():
            for process in self.processes:
                process.send(inputs)
            try:
                return self._run_watching_ranks(inputs)
            except BaseException as error:
                for process in self.processes:   # a collective failing because a rank died says so
                    process.join(timeout=1)
                    process.check_alive()
                self.needs_restart = True
                raise error

    def _run_watching_ranks(self, inputs: StepInputs) -> torch.Tensor | None:
        """Rank 0's share of a step. On the CPU it runs in a thread while this one watches the other
        ranks: a gloo send to a rank that has just died can miss the closed connection and wait out
        the process group's timeout (10 minutes; seen about once in 90 kills), so a dead rank is
        raised from here. On GPUs NCCL queues the work and _wait_for_device watches the ranks."""
        if self.driver.is_cuda:
            return self.driver.execute(inputs)
        outcome = []

        def run():
            try:
                outcome.append((True, self.driver.execute(inputs)))
            except BaseException as error:
                outcome.append((False, error))

        # a daemon: one stuck in gloo must not keep the interpreter from exiting
        thread = threading.Thread(target=run, name="nanovllm-rank0-step", daemon=True)
        thread.start()
        thread.join(timeout=0.05)
        while thread.is_alive():
            for process in self.processes:
                process.check_alive()
            thread.join(timeout=0.05)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

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
            for process in self.processes:
                process.check_alive()
            time.sleep(0.0001)

    def close(self) -> None:
        """Stop the worker processes, leave the process group and free rank 0's device memory."""
        if self.processes:
            if self.needs_restart:     # the processes wait in a collective rank 0 left: do not wait for them
                for process in self.processes:
                    process.kill()
            self._stop_processes()
        clean = all(process.exited_cleanly for process in self.processes)
        self.driver.close()
        if dist.is_initialized():
            if clean:
                dist.destroy_process_group()
            else:   # a rank died: do not wait for it (a plain destroy can hang on NCCL)
                try:
                    dist.distributed_c10d._abort_process_group()
                except (AttributeError, RuntimeError):
                    dist.destroy_process_group()
