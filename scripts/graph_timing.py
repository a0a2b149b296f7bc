"""Time a CUDA graph the way the decode step runs kernels: replayed back to back, no host gaps
between the kernels inside it."""
import numpy as np
import torch


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """Median time of one replay over reps replays (after one untimed), in milliseconds."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def graph_of(fn):
    """fn run once (compiling its kernels), then captured: the graph and what fn returned in it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
