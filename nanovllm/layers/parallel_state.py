"""Which part of the model this process holds: its pipeline stage and, within the stage, its
tensor-parallel rank and group.

World rank = stage * tensor_parallel_size + tp_rank, so each stage's ranks are consecutive. The
worker sets the state once its process group has started and before it builds the model; layers
read it when they are built (their shard, and the group their all-reduce runs in).
"""
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    stage: int = 0
    num_stages: int = 1
    tp_group: object = None      # the stage's ranks; None is the whole world (no pipeline stages)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp_size + tp_rank


_state: ParallelState | None = None


def init_parallel_state(rank: int, tp_size: int, num_stages: int) -> ParallelState:
    """Set this process's state; every rank must call it (a new group is a collective)."""
    global _state
    group = None
    if tp_size > 1 and num_stages > 1:
        for stage in range(num_stages):      # every rank creates every group, in the same order
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            new = dist.new_group(ranks)
            if rank in ranks:
                group = new
    stage, tp_rank = divmod(rank, tp_size)
    _state = ParallelState(tp_rank, tp_size, stage, num_stages, group)
    return _state


def reset_parallel_state() -> None:
    global _state
    _state = None


def parallel_state() -> ParallelState:
    """The state the worker set; without one (layers built outside a worker), the process group's
    world is one tensor-parallel group."""
    if _state is not None:
        return _state
    if dist.is_available() and dist.is_initialized():
        return ParallelState(dist.get_rank(), dist.get_world_size())
    return ParallelState()


def stage_layers(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """The [start, end) decoder layers of a stage: an even split; when it does not divide, the
    stages before the last take one more layer each, from the second to last backwards (the last
    stage also runs the final norm and the LM head), as vLLM splits."""
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        sizes[-2 - i] += 1
    start = sum(sizes[:stage])
    return start, start + sizes[stage]
