"""Host time per step on every rank of a multi-process engine, over a run of bench.py or
bench_latency.py: rank 0's launch of a step, the queueing of its sampling and the wait for its
tokens; every rank's run of a step, and on the others the wait for the next step. A rank whose host
is busy for as long as its GPU computes holds the others back. This found pipeline stages
host-bound while they decoded eagerly (docs/benchmarks.md, "Tensor and pipeline parallelism on two
GPUs").

    PYTHONPATH=. python scripts/rank_host_times.py bench --config configs/qwen3-8b.json --pipeline-parallel-size 2
    PYTHONPATH=. python scripts/rank_host_times.py bench_latency --config configs/qwen3-8b.json --tensor-parallel-size 2

The arguments after the tool's name go to it. The timers wrap Executor and Worker methods in this
process and in the ranks it spawns (they import this file again as their main module); each rank
prints its averages when its worker closes (each engine). Processes only
(distributed_executor_backend="mp").
"""
import argparse
import importlib
import os
import sys
import time

TIMED = {   # (module, class, method) -> label
    ("nanovllm.executor.executor", "Executor", "launch"): "launch",
    ("nanovllm.executor.executor", "Executor", "sample"): "queue sampling",
    ("nanovllm.executor.executor", "Executor", "_wait_for_device"): "wait for tokens",
    ("nanovllm.worker.worker", "Worker", "run"): "run a step",
    ("nanovllm.executor.step_channel", "StepChannel", "receive"): "wait for the next step",
}


totals: dict[str, tuple[int, float]] = {}     # label -> (calls, seconds) since the last report


def report(rank: int) -> None:
    """Print the averages since the last report (an engine's life), and start anew."""
    if totals:
        line = ", ".join(f"{label} {seconds / calls * 1e3:.3f} ms x{calls}"
                         for label, (calls, seconds) in totals.items())
        print(f"rank {rank} (pid {os.getpid()}): {line}", file=sys.stderr, flush=True)
        totals.clear()


def install_timers() -> None:
    """Wrap the TIMED methods to add up their calls and seconds; Worker.close reports them."""

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                calls, seconds = totals.get(label, (0, 0.0))
                totals[label] = (calls + 1, seconds + time.perf_counter() - start)
        setattr(owner, name, wrapper)

    for (module, cls, method), label in TIMED.items():
        timed(getattr(importlib.import_module(module), cls), method, label)
    worker = importlib.import_module("nanovllm.worker.worker").Worker
    close = worker.close

    def close_and_report(self):
        report(self.rank)
        close(self)
    worker.close = close_and_report


if __name__ == "__mp_main__":     # a rank this tool's engine spawned
    install_timers()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tool", choices=["bench", "bench_latency"], help="the benchmark to run, from the repo root")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args()
    install_timers()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tool = importlib.import_module(args.tool)    # this file stays __main__, for the spawned ranks
    sys.argv = [args.tool + ".py", *args.args]
    try:
        tool.main()
    finally:
        report(0)      # rank 0, if the tool left its engine open


if __name__ == "__main__":
    main()
