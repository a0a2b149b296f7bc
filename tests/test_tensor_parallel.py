"""Tensor parallelism over CPU processes (gloo): the same tokens as one process (sampled on the
ranks' vocabulary shards or by rank 0, steps overlapped), and clean failure and shutdown. On a
machine with 2+ GPUs the same tests run over NCCL (device="auto")."""
import glob
import multiprocessing as mp
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from nanovllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from nanovllm.executor import executor as executor_module
from nanovllm.executor import processes
from nanovllm.executor.processes import MULTICAST_OFF, WorkerCall, open_rendezvous
from nanovllm.layers.parallel_state import parallel_state
from tests.conftest import mixed_prompts
from tests.test_step_channel import entries_of, shm_entries

pytestmark = pytest.mark.skipif(
    (torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1) < 2,
    reason="needs 2 devices (GPUs, or CPU cores when there is no GPU)")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run_both(path, prompts, params, **engine_args):
    """Token ids of two identical generate calls (the second hits the prefix cache)."""
    with LLM(path, kvcache_block_size=16, **engine_args) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)
    assert all(o["num_cached_tokens"] > 0 for o, p in zip(second, prompts) if len(p) > 16)
    return [o["token_ids"] for o in first], [o["token_ids"] for o in second]


@pytest.mark.parametrize("engine_args", [
    dict(), dict(max_num_batched_tokens=32, max_num_seqs=4),
    pytest.param(dict(disable_custom_all_reduce=True), marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="the one-shot all-reduce it turns off runs on CUDA only"))],
    ids=["whole-prompts", "chunked-prefill", "nccl-all-reduce"])
def test_two_ranks_give_the_same_tokens_as_one(model_path, hf_greedy, engine_args):
    shared = mixed_prompts(500, lengths=(40,), seed=7)[0]
    prompts = mixed_prompts(500, lengths=(1, 17, 70, 5)) + [shared + [7, 8], shared + [9] * 20]
    one = run_both(model_path, prompts, GREEDY, **engine_args)
    two = run_both(model_path, prompts, GREEDY, tensor_parallel_size=2, **engine_args)
    assert one == two
    assert one[0] == [hf_greedy(model_path, p, 16) for p in prompts]


def seeded(temperature: float, seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=16, ignore_eos=True, **kwargs)


def sampling_paths(llm, monkeypatch) -> dict[str, int]:
    """Count, in rank 0's process, the steps sampled on vocabulary shards, the logits gathers, and
    the schedules made while a step was in flight (the overlap)."""
    counts = dict(shard_steps=0, gathers=0, scheduled_in_flight=0)
    core, driver, gather = llm.engine.core, llm.engine.core.executor.driver, dist.gather

    def count(name, original, when=lambda: True):
        def wrapper(*args, **kwargs):
            counts[name] += when()
            return original(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(driver, "sample_shard", count("shard_steps", driver.sample_shard))
    monkeypatch.setattr(dist, "gather", count("gathers", gather))
    monkeypatch.setattr(core.scheduler, "schedule", count("scheduled_in_flight", core.scheduler.schedule,
                                                          lambda: bool(core.in_flight)))
    return counts


def test_sampling_paths_give_one_ranks_tokens_with_steps_overlapped(model_paths, monkeypatch):
    """Greedy and seeded temperature rows (n > 1 too) are sampled on each rank's vocabulary shard,
    no logits gathered; a batch where one request asks logprobs, a grammar-constrained batch (sampled
    after the step before is collected) and beam search gather the logits to rank 0, which broadcasts
    the ids. Either way every rank holds the ids, the next step is scheduled while one is in flight,
    and tokens equal one rank's (logprobs within float error)."""
    path = model_paths["gqa_tied"]
    prompts = mixed_prompts(500, lengths=(1, 17, 70, 5), seed=5)
    on_shards = [GREEDY, seeded(0.8, 1), seeded(1.3, 2, n=2), seeded(0.6, 3)]
    with_logprobs = [GREEDY, seeded(0.8, 1, logprobs=3), seeded(1.3, 2), GREEDY]
    grammar = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    constrained = [seeded(0.9, i, structured_outputs=grammar) for i in range(2)] + [seeded(0.8, 4), GREEDY]
    beams = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    runs = [("shards", on_shards), ("logprobs", with_logprobs), ("grammar", constrained)]

    def run(llm, counted=None):
        outputs = {}
        for name, params in runs:
            counts = sampling_paths(llm, monkeypatch) if counted is not None else None
            outputs[name] = llm.generate(prompts, params, use_tqdm=False)
            if counted is not None:
                counted[name] = counts
            monkeypatch.undo()
        outputs["beams"] = llm.beam_search(prompts[:2], beams)
        return outputs

    with LLM(path, kvcache_block_size=16) as llm:
        one = run(llm)
    counted = {}
    with LLM(path, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        two = run(llm, counted)
        assert llm.engine.core.overlap
    for name, _ in runs:
        assert [[c["token_ids"] for c in o["outputs"]] for o in two[name]] == \
            [[c["token_ids"] for c in o["outputs"]] for o in one[name]], name
        assert counted[name]["scheduled_in_flight"] > 0, name
    assert counted["shards"]["shard_steps"] > 0 and counted["shards"]["gathers"] == 0
    assert counted["logprobs"]["shard_steps"] == 0 and counted["logprobs"]["gathers"] > 0
    assert counted["grammar"]["gathers"] > 0
    for got, expected in zip(two["logprobs"][1]["logprobs"], one["logprobs"][1]["logprobs"]):
        assert got.keys() == expected.keys()
        assert all(abs(got[t] - expected[t]) < 1e-4 for t in got)
    assert [[b["token_ids"] for b in o["sequences"]] for o in two["beams"]] == \
        [[b["token_ids"] for b in o["sequences"]] for o in one["beams"]]


def test_kv_head_replicated_when_fewer_kv_heads_than_ranks(tmp_path, hf_greedy):
    path = write_tiny_model(str(tmp_path), seed=3, num_attention_heads=4, num_key_value_heads=1)
    prompts = mixed_prompts(500, lengths=(3, 30, 12))
    with LLM(path, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        assert llm.engine.core.executor.driver.kv_cache.tensor.shape[-2] == 1    # each rank keeps the one KV head
        out = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert out == [hf_greedy(path, p, 16) for p in prompts]


def test_dead_worker_fails_fast_and_shutdown_leaves_no_processes(model_paths):
    llm = LLM(model_paths["gqa_tied"], kvcache_block_size=16, tensor_parallel_size=2)
    worker = llm.engine.core.executor.processes[0].process
    shared_memory = shared_memory_of(llm)
    long_run = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    threading.Timer(1.0, worker.kill).start()          # dies in the middle of generate
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 died"):
        llm.generate([[5] * 50] * 8, long_run, use_tqdm=False)
    assert time.monotonic() - start < 15
    with pytest.raises(RuntimeError, match="worker 1 died"):   # and again at once on the next call
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert not mp.active_children()
    assert not shared_memory & shm_entries()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)


def shared_memory_of(llm) -> set[str]:
    """The /dev/shm entries of the channels that carry steps to the workers (step_channel.py)."""
    names = set().union(*(entries_of(w.channel) for w in llm.engine.core.executor.processes))
    assert names <= shm_entries()
    return names


def test_second_engine_after_shutdown(model_paths, hf_greedy):
    path = model_paths["gqa_tied"]
    prompt = mixed_prompts(500, lengths=(20,))[0]
    for _ in range(2):
        with LLM(path, kvcache_block_size=16, tensor_parallel_size=2) as llm:
            pids = [w.process.pid for w in llm.engine.core.executor.processes]
            shared_memory = shared_memory_of(llm)
            assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, prompt, 16)
        assert not mp.active_children()
        assert not shared_memory & shm_entries()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_failed_starts_leave_nothing_behind_and_the_next_engine_starts(model_paths, hf_greedy, tmp_path,
                                                                      monkeypatch):
    """A checkpoint lacking a weight, and a process group rank 0 cannot form (its store refuses writes),
    each fail with their error and leave no process, shared memory, process group or parallel state:
    an engine started next in this process forms its group with fresh ranks (torch counts a group
    whose init failed: uncorrected, the next one waited 10 minutes for them)."""
    path = model_paths["gqa_tied"]
    lacking = write_tiny_model(str(tmp_path / "lacking"))
    shard = glob.glob(f"{lacking}/*.safetensors")[0]
    weights = load_file(shard)
    del weights["model.layers.0.mlp.down_proj.weight"]
    save_file(weights, shard)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
        LLM(lacking, kvcache_block_size=16, tensor_parallel_size=2)
    assert not mp.active_children() and not dist.is_initialized()
    assert parallel_state().tp_size == 1      # rank 0's process-wide state went with it

    before = shm_entries()
    kept = []

    class RefusingStore(dist.Store):
        def set(self, key, value):
            raise dist.DistStoreError(f"refused to set {key}")

    def start_rank_0_on_a_refusing_store(config, multi_token_len=None):
        rendezvous, workers = processes.start_worker_processes(config, multi_token_len)
        kept.append(rendezvous)     # the workers meet here; rank 0 is given a store its group cannot form on
        return RefusingStore(), workers

    with monkeypatch.context() as patch:
        patch.setattr(executor_module, "start_worker_processes", start_rank_0_on_a_refusing_store)
        with pytest.raises(dist.DistStoreError, match="refused to set"):
            LLM(path, kvcache_block_size=16, tensor_parallel_size=2)
    kept.clear()
    assert not mp.active_children() and not dist.is_initialized() and shm_entries() <= before

    prompt = mixed_prompts(500, lengths=(20,))[0]
    start = time.monotonic()
    with LLM(path, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        assert time.monotonic() - start < 60
        with pytest.raises(RuntimeError, match="already initialized"):    # the open engine's group stays its own
            LLM(path, kvcache_block_size=16, tensor_parallel_size=2)
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == hf_greedy(path, prompt, 16)
    assert not mp.active_children()


def test_tensor_parallel_size_is_checked(model_paths):
    path = model_paths["gqa_tied"]          # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=1024"):
        LLM(path, tensor_parallel_size=1024)


def test_interrupts_on_the_tensor_parallel_path(model_paths, hf_greedy, monkeypatch):
    """Each point of the loop interrupted under two ranks: afterwards the pool is consistent and
    tokens equal transformers'. A failure in rank 0's forward pass, after the worker got the step,
    restarts the worker; a Ctrl-C there waits for the step to end."""
    from tests.test_interrupts import (assert_consistent, fail_on_call, generate_until_ctrl_c,
                                       interrupt_each_point_with_ranks)
    path = model_paths["gqa_tied"]
    prompts = mixed_prompts(500, lengths=(30, 3, 17), seed=4)
    expected = [hf_greedy(path, p, 16) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["never appears\x00"])
    with LLM(path, kvcache_block_size=16, tensor_parallel_size=2) as llm:
        interrupt_each_point_with_ranks(llm, prompts, params, GREEDY, expected, monkeypatch)
        # a constrained step samples only after the step before is collected: interrupted there, the
        # worker waits for ids rank 0 never sends, so it is started anew
        workers = [w.process.pid for w in llm.engine.core.executor.processes]
        grammar = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
        fail_on_call(llm.engine.core.executor, "collect", 3, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, SamplingParams(max_tokens=16, seed=1, structured_outputs=grammar), use_tqdm=False)
        assert workers != [w.process.pid for w in llm.engine.core.executor.processes]
        assert_consistent(llm)
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        # a real Ctrl-C, wherever it lands
        generate_until_ctrl_c(llm, prompts * 4, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), 0.3)
        assert_consistent(llm)
        assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert not mp.active_children()


def process_environment(pid: int) -> dict[str, str]:
    """The environment a process started with (Linux)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


def test_collective_rpc_runs_a_worker_method_on_every_rank(model_paths):
    """The executor's seam for work beyond steps (weight updates, sleep): a Worker method runs on
    every rank with the same arguments, results in rank order; a call that fails on a worker
    process answers with its traceback, and the pipe and the engine keep serving."""
    with LLM(model_paths["gqa_tied"], tensor_parallel_size=2, kvcache_block_size=16) as llm:
        executor = llm.engine.core.executor
        copies = executor.collective_rpc("host_to_device", np.arange(3))
        assert len(copies) == 2 and all(copy.tolist() == [0, 1, 2] for copy in copies)
        rank1 = executor.processes[0]
        # NVLink multicast stays off in every rank (on shared machines it can take the GPUs out of service)
        assert MULTICAST_OFF.items() <= process_environment(rank1.process.pid).items()
        rank1.send(WorkerCall("host_to_device", ("not an array",)))
        status, trace = rank1.answer()
        assert status == "error" and "TypeError" in trace
        assert [copy.tolist() for copy in executor.collective_rpc("host_to_device", np.arange(2))] == [[0, 1]] * 2
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]


def test_rank_0_forms_its_group_on_the_store_listening_from_the_start(model_paths, monkeypatch):
    """The ranks' store listens from before they start, and rank 0 forms the group on that very store
    (the worker ranks only connect to it), listening nowhere else: a port only found free, or listened
    on a second time, could be taken by another process in between (EADDRINUSE, or ranks meeting a
    stranger's store)."""
    opened = []

    def open_and_keep(host):
        opened.append(open_rendezvous(host))
        return opened[-1]

    monkeypatch.setattr(processes, "open_rendezvous", open_and_keep)
    with LLM(model_paths["gqa_tied"], tensor_parallel_size=2, kvcache_block_size=16) as llm:
        (rendezvous,) = opened
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", rendezvous.port))
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]["token_ids"]
