"""The shared-memory channel that carries steps to worker processes (executor/step_channel.py):
every StepInputs field arrives as sent, a worker killed mid-step is a clear error, and shutdown
leaves nothing in /dev/shm. No model: a stand-in worker process only receives."""
import multiprocessing as mp
import os
import threading
import time
from dataclasses import fields

import numpy as np
import pytest

from nanovllm.core.step import ShardSampling, StepInputs
from nanovllm.executor.processes import WorkerCall, WorkerProcess, stop_worker_processes
from nanovllm.executor.step_channel import StepChannel

CONTEXT = mp.get_context("spawn")


def ints(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def steps() -> list[StepInputs]:
    """Steps that between them set every field: defaults, empty and 2-D arrays, odd lengths."""
    lens_and_tokens = ints(7, -1, 9, 12, 3, 5).reshape(3, 2)     # columns of it are strided views
    decode = StepInputs(False, lens_and_tokens[:, 1], lens_and_tokens[:, 0] - 1, ints(100, 201, 302),
                        lens_and_tokens[:, 0], np.arange(4), ints(1, 2, 3, 4, 5, 6).reshape(3, 2), np.arange(3),
                        shard_sampling=ShardSampling(np.array([0.0, 0.7, 1.5], np.float32), ints(0, 2**62, 5)))
    prefill = StepInputs(True, np.arange(10, 15), np.arange(5), np.arange(20, 25), ints(5), ints(0, 5),
                         ints(1).reshape(1, 1), np.zeros(0, np.int64), block_copies=ints(3, 4, 5, 6).reshape(2, 2),
                         kv_offloads=ints(7, 8).reshape(1, 2), kv_loads=ints(9, 10, 11, 12).reshape(2, 2),
                         num_shared_tokens=4)
    empty = StepInputs(True, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                       np.zeros(0, np.int64), ints(0), np.zeros((0, 0), np.int64), np.zeros(0, np.int64),
                       shard_sampling=ShardSampling(np.zeros(0, np.float32), np.zeros(0, np.int64)))
    return [decode, prefill, empty]


def assert_same_step(received: StepInputs, sent: StepInputs) -> None:
    for field in fields(StepInputs):
        a, b = getattr(received, field.name), getattr(sent, field.name)
        if isinstance(b, ShardSampling):
            assert_same_arrays(a.temperatures, b.temperatures)
            assert_same_arrays(a.seeds, b.seeds)
        elif isinstance(b, np.ndarray):
            assert_same_arrays(a, b)
        else:
            assert a == b, field.name


def assert_same_arrays(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_every_field_goes_round_and_stays_after_the_slot_is_reused():
    channel = StepChannel.create(CONTEXT, 64)
    sender, receiver = CONTEXT.Pipe()
    try:
        received = []
        for step in steps() * 2:             # more steps than slots: each is copied out of its slot
            channel.send(sender, step, lambda: None)
            received.append(channel.receive(receiver))
        for got, sent in zip(received, steps() * 2):
            assert_same_step(got, sent)
        call = WorkerCall("method", (1,), {"a": 2})
        for message in (call, None):         # what is not a step goes pickled, on the same pipe
            channel.send(sender, message, lambda: None)
            assert channel.receive(receiver) == message
    finally:
        channel.unlink()


def test_a_step_larger_than_a_slot_goes_pickled():
    channel = StepChannel.create(CONTEXT, 8)
    sender, receiver = CONTEXT.Pipe()
    try:
        big = steps()[0]
        channel.send(sender, big, lambda: None)
        assert channel.num_sent == 0
        assert_same_step(channel.receive(receiver), big)
    finally:
        channel.unlink()


def test_a_step_that_cannot_be_written_keeps_its_slot():
    channel = StepChannel.create(CONTEXT, 64)
    sender, receiver = CONTEXT.Pipe()
    try:
        bad = steps()[1]
        bad.positions = bad.positions.astype(np.float64)
        for _ in range(3):                   # more than the slots, and no hang
            with pytest.raises(TypeError):
                channel.send(sender, bad, lambda: None)
        channel.send(sender, steps()[0], lambda: None)
        assert_same_step(channel.receive(receiver), steps()[0])
    finally:
        channel.unlink()


def stuck_worker(conn, channel: StepChannel) -> None:
    """Takes one step and never finishes it."""
    channel.receive(conn)
    time.sleep(600)


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def entries_of(channel: StepChannel) -> set[str]:
    """The channel's names in /dev/shm: its memory and its semaphore."""
    return {channel.memory.name, "sem." + channel.free_slots._semlock.name.lstrip("/")}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory lives in /dev/shm on Linux")
def test_worker_killed_mid_step_is_a_clear_error_and_stopping_leaves_no_shared_memory():
    before = shm_entries()
    channel = StepChannel.create(CONTEXT, 64)
    ours = entries_of(channel)
    assert ours <= shm_entries() - before
    conn, child_end = CONTEXT.Pipe()
    process = CONTEXT.Process(target=stuck_worker, args=(child_end, channel), daemon=True)
    process.start()
    worker = WorkerProcess(1, process, conn, channel)
    step = steps()[0]
    for _ in range(3):      # the worker takes the first; the other two fill the ring
        worker.send(step)
    threading.Timer(0.5, process.kill).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1 died"):
        worker.send(step)   # waits for a free slot until the worker is found dead
    assert time.monotonic() - start < 5
    stop_worker_processes([worker])
    assert not ours & shm_entries()
