"""Time of one tensor-parallel all-reduce inside a CUDA graph on two GPUs, by message size: NCCL
against the one-shot over symmetric memory (layers/all_reduce.py). Sets ONE_SHOT_MAX_BYTES.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=. python scripts/bench_all_reduce.py
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.executor.processes import MULTICAST_OFF, join_rendezvous, open_rendezvous
from nanovllm.layers.all_reduce import OneShotAllReduce

CALLS, REPLAYS = 50, 20


def per_call_us(reduce, x: torch.Tensor) -> float:
    """Microseconds per call of CALLS calls captured in one graph, over REPLAYS replays."""
    reduce(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            reduce(x)
    graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def rank_main(rank: int, port: int, sizes_kib: list[int]) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=join_rendezvous(("127.0.0.1", port)), world_size=2, rank=rank)
    one_shot = OneShotAllReduce(dist.group.WORLD, torch.device("cuda", rank), torch.bfloat16, max(sizes_kib) * 1024)
    for kib in sizes_kib:
        x = torch.randn(kib * 512, device="cuda", dtype=torch.bfloat16) * 1e-3
        nccl = per_call_us(lambda t: dist.all_reduce(t), x)
        symm = per_call_us(one_shot, x)
        if rank == 0:
            print(f"{kib:>5} KiB: NCCL {nccl:6.1f} us, one-shot {symm:6.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-kib", type=lambda text: [int(k) for k in text.split(",")],
                        default=[8, 32, 128, 256, 512, 1024, 2048, 4096], help="comma-separated message sizes")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        parser.error("needs two CUDA devices")
    os.environ.update(MULTICAST_OFF)
    store = open_rendezvous("127.0.0.1")     # held listening until the ranks are done
    mp.spawn(rank_main, args=(store.port, args.sizes_kib), nprocs=2)
