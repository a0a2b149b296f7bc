"""A worker's side of rollout control (docs/rollout.md): weights updated in place, from the
engine's process, from disk or from a trainer's broadcast, and sleep / wake up. Mixed into Worker;
the engine runs these on every rank through Executor.collective_rpc. Checks return their problems
instead of raising, so one rank's refusal never leaves the others apart."""
import torch

from nanovllm.kernels.int_dequantize import release_scratch
from nanovllm.kernels.zeroed_workspace import release_workspaces
from nanovllm.worker.weight_loader import checkpoint_tensors
from nanovllm.worker.weight_sync import WeightSyncGroup, weight_sync_group
from nanovllm.worker.weight_update import InPlaceWeightLoader, PinnedStaging, tensor_shape


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtypes: {dtype!r} is not a torch dtype")
    return found


class WorkerRollout:
    weight_sync: WeightSyncGroup | None = None
    weights_asleep = kv_cache_asleep = False
    slept_weights: dict[str, tuple[torch.Tensor | None, torch.Size, torch.dtype]] | None = None
    host_weights: torch.Tensor | None = None    # pinned, for level-1 sleeps (kept between them)
    pinned_staging: PinnedStaging | None = None   # host tensors' way in, its pinned buffers kept between updates

    def _in_place_loader(self) -> InPlaceWeightLoader:
        if self.pinned_staging is None:
            self.pinned_staging = PinnedStaging(self.device)
        return InPlaceWeightLoader(self.model, self.model.checkpoint_shapes, self.config.torch_dtype,
                                   self.pinned_staging)

    # ---- weights -------------------------------------------------------------------------------

    def check_weight_update(self, metadata: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        return self._in_place_loader().problems(metadata)

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        loader = self._in_place_loader()
        for name, tensor in named_tensors:
            loader.load(name, tensor)
        loader.finish()

    def check_checkpoint_update(self, path: str) -> list[str]:
        return self._in_place_loader().problems((name, tensor_shape(t)) for name, t in checkpoint_tensors(path))

    def update_weights_from_disk(self, path: str) -> None:
        self.update_weights(checkpoint_tensors(path))     # each rank reads only its slices

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int, backend: str) -> None:
        self.weight_sync = weight_sync_group(master_address, master_port, rank_offset + self.rank, world_size, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list, load: bool) -> None:
        """Receive each tensor the trainer broadcasts and load it (when `load`: the names and shapes
        were found good; otherwise every tensor is still received, so the trainer is not left waiting)."""
        group = self.weight_sync
        device = self.device if group.backend == "nccl" else torch.device("cpu")
        loader = self._in_place_loader()
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = group.broadcast(torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device))
            if load:
                loader.load(name, tensor)
        loader.finish()

    # ---- sleep ---------------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        """Free the KV pool, the CUDA graphs and the kernels' scratch memory; weights to host memory
        (level 1) or dropped (2)."""
        self.graphs = []     # they captured the pool's and the weights' addresses
        release_workspaces()
        release_scratch()
        if not self.kv_cache_asleep:
            self.kv_cache.release()
            self.kv_cache_asleep = True
        if not self.weights_asleep:
            params = dict(self.model.named_parameters())     # a tied LM head is listed once
            hosts = dict.fromkeys(params)
            if level == 1:
                hosts = self._host_copies(params) if self.is_cuda else {name: p.data for name, p in params.items()}
            self.slept_weights = {name: (hosts[name], p.shape, p.dtype) for name, p in params.items()}
            for param in params.values():
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            self.weights_asleep = True
        elif level == 2:      # asleep at level 1 before: drop the host copies too
            self.slept_weights = {name: (None, shape, dtype) for name, (_, shape, dtype) in self.slept_weights.items()}
        if level == 2:
            self.host_weights = None
        if self.is_cuda:
            torch.cuda.empty_cache()

    def _host_copies(self, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
        """Copy the weights into one pinned host buffer, allocated at the first sleep and kept for the
        next ones: pinning is what costs (18-22 s a sleep for the Qwen3-8B shape when every sleep
        pinned fresh copies, docs/benchmarks.md), the copy itself runs at the link's speed."""
        starts, size = {}, 0
        for name, param in params.items():
            starts[name] = size
            size += -(-param.nbytes // 256) * 256      # each view 256-byte aligned
        if self.host_weights is None or self.host_weights.numel() != size:
            self.host_weights = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        hosts = {}
        for name, param in params.items():
            view = self.host_weights[starts[name]:starts[name] + param.nbytes].view(param.dtype).view(param.shape)
            hosts[name] = view.copy_(param.data, non_blocking=True)
        torch.cuda.synchronize(self.device)     # before the device copies are freed
        return hosts

    def wake_up(self, tags: list[str]) -> None:
        """Bring back what `tags` name; once both are back, recapture the CUDA graphs."""
        if "weights" in tags and self.weights_asleep:
            params = dict(self.model.named_parameters())
            for name, (host, shape, dtype) in self.slept_weights.items():
                # dropped weights come back uninitialized: an update must fill them
                params[name].data = (host.to(self.device, non_blocking=True) if host is not None
                                     else torch.empty(shape, dtype=dtype, device=self.device))
            self.slept_weights, self.weights_asleep = None, False
        if "kv_cache" in tags and self.kv_cache_asleep:
            self.kv_cache.allocate(self.num_kvcache_blocks)
            self.kv_cache_asleep = False
        if not (self.weights_asleep or self.kv_cache_asleep) and self.is_cuda and not self.config.enforce_eager \
                and not self.graphs:
            torch.cuda.synchronize(self.device)
            self._capture_graphs(self.multi_token_len)
