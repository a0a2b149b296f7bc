"""What handing one step's StepInputs to a worker process costs on this CPU, pickled through the
pipe (as before issue 44) and through shared memory (WorkerProcess.send, step_channel.py). Rank 0
sends realistic steps (decode of 1, 64 and 256 sequences with the block tables of a 4096-token
context at block size 256 and shard sampling, and a 2048-token prefill) to one spawned process; it
notes when it holds the StepInputs and acknowledges, and the next step goes only then. Prints, per
step kind, the median and p90 of rank 0's send call and of send-to-received (one monotonic clock).

    PYTHONPATH=. python scripts/bench_step_send.py [--steps 300]
"""
import argparse
import multiprocessing as mp
import struct
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per kind (after 30 untimed)")
    return parser.parse_args()


def make_steps() -> dict:
    """The steps of each kind, built as the executor builds them."""
    import numpy as np

    from nanovllm.core.sequence import Sequence
    from nanovllm.core.step import ScheduledBatch
    from nanovllm.executor.sampling_inputs import build_shard_sampling
    from nanovllm.executor.step_inputs import build_step_inputs
    from nanovllm.sampling_params import SamplingParams

    block_size, rng = 256, np.random.default_rng(0)

    def seq(num_tokens: int, num_computed: int, first_block: int) -> Sequence:
        s = Sequence(rng.integers(0, 150000, num_tokens).tolist(), SamplingParams(temperature=0.0, max_tokens=64))
        s.num_computed_tokens = num_computed
        s.block_table = list(range(first_block, first_block + -(-num_tokens // block_size)))
        return s

    steps = {}
    for batch in (1, 64, 256):
        seqs = [seq(4096, 4095, 16 * i) for i in range(batch)]
        inputs = build_step_inputs(ScheduledBatch(seqs, [1] * batch, False), block_size)
        inputs.shard_sampling = build_shard_sampling(seqs, rng)
        steps[f"decode {batch}"] = inputs
    prompt = seq(2048, 0, 0)
    inputs = build_step_inputs(ScheduledBatch([prompt], [2048], True), block_size)
    inputs.shard_sampling = build_shard_sampling([prompt], rng)
    steps["prefill 2048"] = inputs
    return steps


def receiver(conn, acks, channel) -> None:
    """The worker's side: take each step as worker_main does, and say when it was in hand."""
    receive = conn.recv if channel is None else lambda: channel.receive(conn)
    while (message := receive()) is not None:
        received = time.perf_counter_ns()
        acks.send_bytes(struct.pack("qq", received, len(message.input_ids)))


def measure(steps: dict, num_steps: int, shared_memory: bool) -> None:
    import numpy as np

    from nanovllm.executor.processes import WorkerProcess
    from nanovllm.executor.step_channel import StepChannel

    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    acks, child_acks = context.Pipe(duplex=False)
    channel = StepChannel.create(context, 2**17)
    process = context.Process(target=receiver, args=(child_conn, child_acks, channel if shared_memory else None),
                              daemon=True)
    process.start()
    worker = WorkerProcess(1, process, conn, channel)
    print("shared memory" if shared_memory else "pickled through the pipe")
    print(f"{'step':14} {'bytes':>8} {'send p50':>9} {'p90':>7} {'received p50':>13} {'p90':>7}  (us)")
    for kind, inputs in steps.items():
        send_us, received_us = [], []
        for i in range(30 + num_steps):
            start = time.perf_counter_ns()
            if shared_memory:
                worker.send(inputs)
            else:           # WorkerProcess.send before step_channel.py
                worker.check_alive()
                conn.send(inputs)
            sent = time.perf_counter_ns()
            received, num_tokens = struct.unpack("qq", acks.recv_bytes())
            assert num_tokens == len(inputs.input_ids)
            if i >= 30:
                send_us.append((sent - start) / 1e3)
                received_us.append((received - start) / 1e3)
        nbytes = sum(a.nbytes for a in (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.context_lens,
                                        inputs.cu_seqlens_q, inputs.block_tables, inputs.logits_indices,
                                        inputs.shard_sampling.temperatures, inputs.shard_sampling.seeds))
        p = lambda xs, q: np.percentile(xs, q)  # noqa: E731
        print(f"{kind:14} {nbytes:8d} {p(send_us, 50):9.1f} {p(send_us, 90):7.1f} {p(received_us, 50):13.1f} "
              f"{p(received_us, 90):7.1f}")
    conn.send(None)
    process.join()
    channel.unlink()


def main():
    args = parse_args()
    steps = make_steps()
    for shared_memory in (False, True):
        measure(steps, args.steps, shared_memory)


if __name__ == "__main__":
    main()
