"""Rollout control, the engine's side (docs/rollout.md): what RL trainers drive between (or, paused,
in the middle of) batches of rollouts. Weights are updated in place on every rank (the workers'
side is worker/rollout.py), each update counted in `weight_version`; sleep frees the KV pool and
moves or drops the weights. Mixed into LLMEngine."""
import glob
import os
from collections.abc import Iterable

import torch

from nanovllm.worker.weight_sync import BACKENDS
from nanovllm.worker.rollout import parse_dtype

SLEEP_TAGS = ("weights", "kv_cache")


class EngineAsleepError(RuntimeError):
    """A request reached an engine that is asleep (the server answers 503)."""


class EngineRollout:
    weight_version = 0
    asleep: set[str] = frozenset()      # which of SLEEP_TAGS are asleep

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_awake(self) -> None:
        if self.asleep:
            raise EngineAsleepError(f"the engine is asleep ({', '.join(sorted(self.asleep))} released by sleep()); "
                               f"call wake_up() before generating")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (GPU and host tier). Safe while requests run: their blocks
        stay theirs but are no longer shared, and they cache nothing more. Returns True (vLLM's
        signature, whose engine refuses while blocks are in use)."""
        self.check_running()
        self.core.scheduler.block_manager.reset_prefix_cache()
        return True

    def _finish_update(self, weight_version: int | None) -> int:
        self.reset_prefix_cache()
        self.weight_version = self.weight_version + 1 if weight_version is None else weight_version
        self.outputs.weight_version = self.weight_version
        return self.weight_version

    def _check_update(self, weight_version: int | None) -> None:
        self.check_running()
        if "weights" in self.asleep:
            raise RuntimeError("the weights are asleep; call wake_up(tags=['weights']) before updating them")
        if weight_version is not None and (isinstance(weight_version, bool) or not isinstance(weight_version, int)):
            raise TypeError(f"weight_version must be an int or None, got {weight_version!r}")

    @staticmethod
    def _raise_problems(answers: list[list[str]]) -> None:
        problems = [p for rank in answers for p in rank]
        if problems:
            raise ValueError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: int | None = None) -> int:
        """Load (checkpoint name, tensor) pairs in place on every rank; every name and shape is
        checked first (ValueError, nothing changed). Returns the new weight_version."""
        self._check_update(weight_version)
        if isinstance(weights, dict):
            weights = weights.items()
        weights = list(weights)
        for i, item in enumerate(weights):
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], torch.Tensor)):
                raise TypeError(f"weights[{i}] must be a (name, tensor) pair, got {type(item).__name__}")
        executor = self.core.executor
        self._raise_problems(executor.collective_rpc("check_weight_update", [(n, tuple(t.shape)) for n, t in weights]))
        if executor.processes:       # tensors go to the other ranks pickled through pipes
            weights = [(name, tensor.detach().cpu()) for name, tensor in weights]
        executor.collective_rpc("update_weights", weights)
        return self._finish_update(weight_version)

    def update_weights_from_disk(self, path: str, weight_version: int | None = None) -> int:
        """update_weights from a safetensors checkpoint directory of the same architecture; each rank
        reads only its slices."""
        self._check_update(weight_version)
        if not isinstance(path, (str, os.PathLike)) or not glob.glob(os.path.join(path, "*.safetensors")):
            raise ValueError(f"model_path: {path!r} is not a directory holding *.safetensors files")
        executor = self.core.executor
        self._raise_problems(executor.collective_rpc("check_checkpoint_update", str(path)))
        executor.collective_rpc("update_weights_from_disk", str(path))
        return self._finish_update(weight_version)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str = "nccl") -> None:
        """Join a trainer's weight-transfer group: the trainer is rank 0, engine rank r is rank_offset + r.
        Blocks until every member has joined (the trainer calls worker/weight_sync.py's weight_sync_group)."""
        self.check_running()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        if backend == "nccl" and self.config.device != "cuda":
            raise ValueError("backend 'nccl' needs an engine on GPUs; use 'gloo'")
        tp = self.config.tensor_parallel_size
        if not (isinstance(rank_offset, int) and rank_offset >= 1):
            raise ValueError(f"rank_offset must be an int >= 1 (the trainer is rank 0), got {rank_offset!r}")
        if not (isinstance(world_size, int) and world_size >= rank_offset + tp):
            raise ValueError(f"world_size={world_size!r} must hold rank_offset={rank_offset} + {tp} engine rank(s)")
        self.core.executor.collective_rpc("init_weight_update_group", master_address, int(master_port),
                                          rank_offset, world_size, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        weight_version: int | None = None) -> int:
        """Receive the tensors the trainer broadcasts, in this order, and load them in place. A bad
        name or shape: every tensor is still received (the trainer is not left waiting), none is
        loaded, and a ValueError names it."""
        self._check_update(weight_version)
        executor = self.core.executor
        if executor.driver.weight_sync is None:
            raise RuntimeError("call init_weight_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        dtypes = [str(parse_dtype(dtype)).removeprefix("torch.") for dtype in dtypes]
        shapes = [tuple(int(n) for n in shape) for shape in shapes]
        problems = executor.collective_rpc("check_weight_update", list(zip(names, shapes)))
        executor.collective_rpc("update_weights_from_distributed", list(names), dtypes, shapes,
                                not any(problems))
        self._raise_problems(problems)
        return self._finish_update(weight_version)

    # ---- sleep ---------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (its cached prefixes are forgotten) and move the weights to host memory
        (level 1) or drop them (level 2: an update must refill them after wake_up). No request may
        be live."""
        self.check_running()
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        core = self.core
        if not core.scheduler.is_finished() or core.in_flight:
            raise RuntimeError("sleep() needs an idle engine: finish or abort the running requests first")
        self.reset_prefix_cache()
        core.executor.collective_rpc("sleep", level)
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights, the KV pool, or both (tags None); CUDA graphs are recaptured once
        both are back."""
        self.check_running()
        tags = list(SLEEP_TAGS) if tags is None else ([tags] if isinstance(tags, str) else list(tags))
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"tags: {unknown} unknown; use {list(SLEEP_TAGS)} or None")
        self.core.executor.collective_rpc("wake_up", tags)
        self.asleep = set(self.asleep) - set(tags)
