"""The host tier's memory on one rank, and the copies between it and the KV pool (kv_cache.py).

The block manager decides which block goes where (engine/host_block_pool.py); a step carries those
copies here, and they are made before the step's own work, through a small staging buffer on the
device (two slots of a few blocks each, so that the copy engine moves one slot while the other
fills), in this order:

- offloads: each evicted GPU block is copied into a slot on the compute stream (in its order:
  after the step before wrote the block, before this step writes its slot again), and a side
  stream copies the slot to host memory while the step runs;
- loads: the side stream copies host blocks into a slot (after every earlier offload, which may
  have written them), the compute stream waits for that copy, then copies them into their GPU
  slots. Only a step that loads waits for the copy engine, or one that offloads more blocks than
  the staging holds at once.

A host block holds one GPU block's bytes for every layer, keys and values, in one contiguous row,
so a copy moves whole blocks at the link's speed. The bytes move as they are: a float8 pool's scales
are per layer and fixed at start-up (kv_cache.py), so its blocks come back exactly. On the CPU the
host tier is a second plain tensor, the same copies run at once, and the streams are left out.
"""
import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.worker.kv_cache import KVCache

STAGING_BYTES = 512 << 20    # both slots together; each holds at least one block


@dataclass(slots=True)
class StagingSlot:
    buffer: torch.Tensor                     # [blocks, block_bytes] on the device
    free: torch.cuda.Event | None = None     # recorded after the last queued copy that reads or fills it


class HostKVCache:
    def __init__(self, kv_cache: KVCache, num_blocks: int):
        self.kv_cache = kv_cache
        self.num_blocks = num_blocks
        device = kv_cache.device
        self.is_cuda = device.type == "cuda"
        block_bytes = kv_cache.block_bytes
        self.tensor = torch.empty(num_blocks, block_bytes, dtype=torch.uint8)
        if self.is_cuda:
            page_lock(self.tensor)
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        slot_blocks = max(1, min(num_blocks, STAGING_BYTES // 2 // block_bytes))
        self.slots = [StagingSlot(torch.empty(slot_blocks, block_bytes, dtype=torch.uint8, device=device),
                                  torch.cuda.Event() if self.is_cuda else None) for _ in range(2)]
        self.next_slot = 0

    @property
    def slot_blocks(self) -> int:
        return self.slots[0].buffer.shape[0]

    def transfer(self, offloads: np.ndarray, loads: np.ndarray) -> None:
        """Make a step's copies: offloads [n, 2] of (GPU block, host block), then loads [m, 2] of
        (host block, GPU block)."""
        pool = self.kv_cache.tensor.view(torch.uint8)   # [2, layers, blocks, block_size, kv_heads, row bytes]
        for start in range(0, len(offloads), self.slot_blocks):
            self._offload(pool, offloads[start:start + self.slot_blocks])
        for start in range(0, len(loads), self.slot_blocks):
            self._load(pool, loads[start:start + self.slot_blocks])

    def _offload(self, pool: torch.Tensor, pairs: np.ndarray) -> None:
        slot = self._take_slot()
        compute = torch.cuda.current_stream() if self.is_cuda else None
        if self.is_cuda:
            compute.wait_event(slot.free)
        for j, gpu_block in enumerate(pairs[:, 0].tolist()):
            slot.buffer[j].view(pool[:, :, 0].shape).copy_(pool[:, :, gpu_block])
        with self._on_side_stream(compute):
            for start, end, first_host in runs(pairs[:, 1]):
                self.tensor[first_host:first_host + end - start].copy_(slot.buffer[start:end], non_blocking=True)
            if self.is_cuda:
                slot.free.record(self.stream)

    def _load(self, pool: torch.Tensor, pairs: np.ndarray) -> None:
        slot = self._take_slot()
        compute = torch.cuda.current_stream() if self.is_cuda else None
        with self._on_side_stream(compute):
            if self.is_cuda:
                self.stream.wait_event(slot.free)
            for start, end, first_host in runs(pairs[:, 0]):
                slot.buffer[start:end].copy_(self.tensor[first_host:first_host + end - start], non_blocking=True)
        if self.is_cuda:
            compute.wait_stream(self.stream)
        for j, gpu_block in enumerate(pairs[:, 1].tolist()):
            pool[:, :, gpu_block].copy_(slot.buffer[j].view(pool[:, :, 0].shape))
        if self.is_cuda:
            slot.free.record(compute)

    def _take_slot(self) -> StagingSlot:
        slot = self.slots[self.next_slot]
        self.next_slot ^= 1
        return slot

    def _on_side_stream(self, compute: torch.cuda.Stream | None):
        """The side stream, once it has caught up with the compute stream (on a CPU: nothing)."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(compute)
        return torch.cuda.stream(self.stream)

    def release(self) -> None:
        if self.is_cuda and self.tensor is not None:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.tensor = None
        self.slots = []


def page_lock(tensor: torch.Tensor) -> None:
    """Pin a host tensor where it is, so that copies run on the copy engine without the host
    waiting. (pin_memory=True would round the request up to a power of two: 40 GiB would take 64.)"""
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(error) != 0:
        raise RuntimeError(f"kv_offload_gib: pinning {tensor.numel() * tensor.element_size() / 2**30:.1f} GiB of host "
                           f"memory failed (CUDA error {int(error)}); a smaller kv_offload_gib, or a larger "
                           "locked-memory limit (ulimit -l), may fit")


def runs(host_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, first host id) of each run of consecutive host ids: one copy per run."""
    breaks = np.flatnonzero(np.diff(host_ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(host_ids)]])
    return [(int(s), int(e), int(host_ids[s])) for s, e in zip(starts, ends)]
