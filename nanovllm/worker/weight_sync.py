"""A process group of its own for sending weights from a trainer to the engine's ranks.

The engine's ranks already belong to the default process group (tensor parallelism), and a process
can join only one default group; so, as vLLM's StatelessProcessGroup and SGLang's
init_custom_process_group do, this one is made straight from a TCPStore, outside torch.distributed's
global state. The trainer is rank 0 (it hosts the store) and broadcasts; engine rank r joins as
rank_offset + r. Gloo for CPU tensors, NCCL for GPU tensors.
"""
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")


class WeightSyncGroup:
    """The group and the store it meets through (which must outlive it)."""

    def __init__(self, group, store, rank: int, world_size: int, backend: str):
        self.group, self.store, self.rank, self.world_size, self.backend = group, store, rank, world_size, backend

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Send (rank src) or receive (the others, into `tensor`) one tensor; waits until done."""
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self.group.broadcast([tensor], options).wait()
        return tensor


def weight_sync_group(master_address: str, master_port: int, rank: int, world_size: int,
                      backend: str = "nccl", timeout: timedelta = timedelta(minutes=10)) -> WeightSyncGroup:
    """Join (rank 0: host) the group; every member calls this with the same address, port and size."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("nanovllm_weight_sync", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    return WeightSyncGroup(group, store, rank, world_size, backend)
