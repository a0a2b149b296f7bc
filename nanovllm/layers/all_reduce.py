"""The sum of a layer's partial outputs over its tensor-parallel ranks.

A decode step sums small tensors: two per decoder layer (attention's o_proj and the MLP's
down_proj), batch x hidden each, 8 KiB at batch 1 of an 8B model. For those, NCCL's all-reduce
costs 7.5-20 us a call inside a CUDA graph on two H200s; a one-shot all-reduce over symmetric
memory costs 6-9 us. Symmetric memory maps every rank's buffer into every other rank's address
space, so one kernel can copy this rank's input into its buffer, meet the peers at a barrier and
read and sum every rank's buffer directly. torch.distributed's symmetric memory provides that
kernel (`one_shot_all_reduce_copy`) and it replays in CUDA graphs.

It pays for small messages only (each rank reads every peer's whole buffer), so tensors above
ONE_SHOT_MAX_BYTES go to the group's backend (NCCL, gloo on the CPU), as do dtypes the kernel does
not sum (float16). NVLink multicast stays off (executor/processes.py sets the variables): this uses
peer-to-peer mappings only. `disable_custom_all_reduce=True` sends everything to the backend.
"""
import warnings

import torch
import torch.distributed as dist

ONE_SHOT_MAX_BYTES = 512 * 1024    # batch 64 of a 4096-wide bfloat16 model; measured in docs/benchmarks.md
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)


class OneShotAllReduce:
    """One symmetric buffer of max_bytes in the model's dtype, shared with the group's ranks."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = ONE_SHOT_MAX_BYTES):
        from torch.distributed import _symmetric_memory as symm_mem
        self.group_name = group.group_name
        with warnings.catch_warnings():     # needed by older torch, a no-op (and a warning) on newer
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)     # a collective: every rank of the group

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer[:x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)


_one_shot: OneShotAllReduce | None = None


def start_one_shot_all_reduce(group: dist.ProcessGroup | None, device: torch.device, dtype: torch.dtype) -> None:
    """Every rank of the tensor-parallel group calls this once, after the process group starts
    (None: the whole world) and before the first step; only on CUDA and for a dtype it sums."""
    global _one_shot
    if device.type == "cuda" and dtype in ONE_SHOT_DTYPES:
        _one_shot = OneShotAllReduce(group or dist.group.WORLD, device, dtype)


def stop_one_shot_all_reduce() -> None:
    global _one_shot
    _one_shot = None


def tensor_parallel_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of x over the group's ranks; x itself may be overwritten with it, or not: use the result."""
    if _one_shot is not None and _one_shot.fits(x):
        return _one_shot(x)
    dist.all_reduce(x, group=group)
    return x
