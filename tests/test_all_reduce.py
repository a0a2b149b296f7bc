"""The tensor-parallel all-reduce (layers/all_reduce.py) over two ranks against its twin, the sum of
both ranks' inputs computed on one rank: on two GPUs the one-shot kernel over symmetric memory for
sums up to its buffer (eagerly and replayed in a CUDA graph), NCCL above it and for float16; over
gloo on the CPU, where there is no one-shot, the backend's sum. The engine at TP=2 with and
without the one-shot: tests/test_tensor_parallel.py (on 2 GPUs it runs over NCCL)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.executor.processes import MULTICAST_OFF, join_rendezvous, open_rendezvous
from nanovllm.layers import all_reduce
from nanovllm.layers.all_reduce import ONE_SHOT_MAX_BYTES, start_one_shot_all_reduce, stop_one_shot_all_reduce, \
    tensor_parallel_all_reduce

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HIDDEN = 4096
# rows of a 4096-wide tensor: batch 1, an odd batch, the largest bfloat16 sum the buffer takes, one row more
ROWS = [1, 13, ONE_SHOT_MAX_BYTES // (2 * HIDDEN), ONE_SHOT_MAX_BYTES // (2 * HIDDEN) + 1]


def inputs(rank: int, rows: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rows + rank)
    return torch.randn(rows, HIDDEN, generator=generator).to(device, dtype)


def expected_sum(rows: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The twin: both ranks' inputs summed on this rank (in float32, rounded once, as both sum two)."""
    return (inputs(0, rows, dtype, device).float() + inputs(1, rows, dtype, device).float()).to(dtype)


def one_shot_calls(rows: int, dtype: torch.dtype) -> bool:
    return all_reduce._one_shot is not None and all_reduce._one_shot.fits(torch.empty(rows, HIDDEN, dtype=dtype))


def check_rank(rank: int, port: int, device_type: str, failures) -> None:
    try:
        device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            os.environ.update(MULTICAST_OFF)     # as the engine's ranks: no NVLink multicast object, ever
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=join_rendezvous(("127.0.0.1", port)),
                                world_size=2, rank=rank)
        start_one_shot_all_reduce(None, torch.device(device), torch.bfloat16)
        assert (all_reduce._one_shot is not None) == (device_type == "cuda")
        dtypes = [torch.bfloat16, torch.float16] if device_type == "cuda" else [torch.float32]
        for dtype in dtypes:
            for rows in ROWS:
                x = inputs(rank, rows, dtype, device)
                total = tensor_parallel_all_reduce(x.clone(), None)
                assert torch.equal(total, expected_sum(rows, dtype, device)), (rows, dtype)
        if device_type == "cuda":
            check_in_cuda_graph(rank, device)
        stop_one_shot_all_reduce()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as error:    # reported to the test by the queue: a child's assert is not seen
        failures.put(f"rank {rank}: {error!r}")
        raise


def check_in_cuda_graph(rank: int, device: str) -> None:
    """Captured once, replayed over new inputs: each replay's sum is the new inputs' sum."""
    assert one_shot_calls(1, torch.bfloat16)
    static = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device=device)
    tensor_parallel_all_reduce(static.clone(), None)    # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tensor_parallel_all_reduce(static * 1, None)
    for rows_seed in (3, 5, 7):
        static.copy_(inputs(rank, 8 * rows_seed, torch.bfloat16, device)[:8])
        graph.replay()
        twin = expected_sum(8 * rows_seed, torch.bfloat16, device)[:8]
        assert torch.equal(out, twin), rows_seed


def run_two_ranks(device_type: str) -> None:
    store = open_rendezvous("127.0.0.1")    # held listening until the ranks are done
    port = store.port
    context = mp.get_context("spawn")
    failures = context.Queue()
    ranks = [context.Process(target=check_rank, args=(rank, port, device_type, failures)) for rank in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=240)
    alive = [p for p in ranks if p.is_alive()]
    for p in alive:
        p.kill()
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not alive and not errors and all(p.exitcode == 0 for p in ranks), (errors, [p.exitcode for p in ranks])


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs (the one-shot runs on CUDA only)")
def test_one_shot_sum_equals_twin_on_two_gpus():
    """bfloat16 up to the buffer by the one-shot (eager and in a CUDA graph), past it and float16 by NCCL."""
    run_two_ranks("cuda")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_cpu_ranks_sum_by_gloo():
    """No one-shot on the CPU: start_one_shot_all_reduce leaves it off and gloo sums."""
    run_two_ranks("cpu")


def test_argument_is_checked(model_paths):
    from nanovllm.config import Config
    with pytest.raises(TypeError, match="disable_custom_all_reduce"):
        Config(next(iter(model_paths.values())), disable_custom_all_reduce="yes")
