"""The host tier's memory on one rank, and the copies between it and the KV pool (kv_cache.py).

The block manager decides which block goes where (engine/host_block_pool.py); a step carries those
copies here, and they are made before the step's own work, in this order:

- offloads: the evicted GPU blocks are gathered on the compute stream (in its order: after the
  step before wrote them, before this step writes their slots again) into a staging buffer, which a
  side stream copies to host memory while the step runs;
- loads: the side stream copies the host blocks to a staging buffer (after every earlier offload,
  which may have written them), and the compute stream waits for that copy, then scatters the
  blocks into their GPU slots. Only a step that loads waits for the copy engine.

A host block holds one GPU block's bytes for every layer, keys and values, in one contiguous row,
so a copy moves whole blocks at the link's speed. The bytes move as they are: a float8 pool's scales
are per layer and fixed at start-up (kv_cache.py), so its blocks come back exactly. On the CPU the
host tier is a second plain tensor and the copies are immediate (what the tests run).
"""
import numpy as np
import torch

from nanovllm.worker.kv_cache import KVCache


class HostKVCache:
    def __init__(self, kv_cache: KVCache, num_blocks: int):
        self.kv_cache = kv_cache
        self.num_blocks = num_blocks
        self.is_cuda = kv_cache.device.type == "cuda"
        # pinned, so that copies run on the copy engine without the host waiting
        self.tensor = torch.empty(num_blocks, kv_cache.block_bytes, dtype=torch.uint8, pin_memory=self.is_cuda)
        self.stream = torch.cuda.Stream(kv_cache.device) if self.is_cuda else None

    def _pool_bytes(self) -> torch.Tensor:
        """The KV pool as bytes: [2, layers, blocks, block_size, kv_heads, head_dim * itemsize]."""
        return self.kv_cache.tensor.view(torch.uint8)

    def transfer(self, offloads: np.ndarray, loads: np.ndarray) -> None:
        """Make a step's copies: offloads [n, 2] of (GPU block, host block), then loads [m, 2] of
        (host block, GPU block)."""
        if len(offloads):
            self._offload(offloads[:, 0], offloads[:, 1])
        if len(loads):
            self._load(loads[:, 0], loads[:, 1])

    def _offload(self, gpu_ids: np.ndarray, host_ids: np.ndarray) -> None:
        pool = self._pool_bytes()
        staged = pool[:, :, self._index(gpu_ids)].movedim(2, 0).reshape(len(gpu_ids), -1)
        if not self.is_cuda:
            self.tensor[torch.from_numpy(host_ids)] = staged
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for start, end, first_host in runs(host_ids):
                self.tensor[first_host:first_host + end - start].copy_(staged[start:end], non_blocking=True)
        staged.record_stream(self.stream)

    def _load(self, host_ids: np.ndarray, gpu_ids: np.ndarray) -> None:
        pool = self._pool_bytes()
        shape = (len(gpu_ids), *pool.shape[:2], *pool.shape[3:])
        if not self.is_cuda:
            staged = self.tensor[torch.from_numpy(host_ids)]
        else:
            staged = torch.empty(len(gpu_ids), self.tensor.shape[1], dtype=torch.uint8, device=pool.device)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for start, end, first_host in runs(host_ids):
                    staged[start:end].copy_(self.tensor[first_host:first_host + end - start], non_blocking=True)
            staged.record_stream(self.stream)
            torch.cuda.current_stream().wait_stream(self.stream)
        pool[:, :, self._index(gpu_ids)] = staged.view(shape).movedim(0, 2)

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        return index.pin_memory().to(self.kv_cache.device, non_blocking=True) if self.is_cuda else index

    def release(self) -> None:
        self.tensor = None


def runs(host_ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, first host id) of each run of consecutive host ids: one copy per run."""
    breaks = np.flatnonzero(np.diff(host_ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(host_ids)]])
    return [(int(s), int(e), int(host_ids[s])) for s, e in zip(starts, ends)]
