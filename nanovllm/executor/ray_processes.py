"""Ranks 1..N-1 as Ray actors (distributed_executor_backend="ray"), possibly on other machines.

Each rank is an actor holding the same Worker that worker_main builds, placed by a placement group
per pipeline stage: one bundle per rank ({"GPU": 1}, or {"CPU": 1} on a cluster without GPUs),
STRICT_PACK, so a tensor-parallel group sits on one node while stages may sit on different nodes.
Rank 0 stays in the engine's process and takes a bundle of the stage placed on its own node.

A RayRank has WorkerProcess's interface: a step is an actor call whose ObjectRef is kept, not
awaited (as a pipe's send is not); check_alive looks at those refs, so a killed actor or a failed
step is a RuntimeError naming the rank and its node. Ray is joined as RayLLM joins it: already
initialised in this process, it is used as it is; else `ray.init()` joins the cluster named by
RAY_ADDRESS or one `ray start` runs on this machine, else starts a local one (shut down at close).
"""
import os
import time
import traceback
from dataclasses import dataclass, field

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.step import StepInputs
from nanovllm.executor.processes import LOADED, MULTICAST_OFF, WorkerCall, join_rendezvous, open_rendezvous
from nanovllm.worker.worker import Worker

# How long to wait for the cluster to grant every stage's bundles, and for actors to stop.
PLACEMENT_TIMEOUT_S = 300.0
GRACEFUL_STOP_S = 30.0


class RayWorker:
    """The actor: one rank's Worker, built by `load` (the constructor is empty, so an error in the
    Worker comes back as a task error naming the rank)."""

    def __init__(self):
        self.worker: Worker | None = None

    def where(self) -> tuple[str, str, int]:
        """(node id, node IP, process id) of this actor."""
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def load(self, config: Config, rank: int, rendezvous: tuple[str, int], multi_token_len: int | None) -> str:
        self.worker = Worker(config, rank, join_rendezvous(rendezvous), multi_token_len)
        return LOADED

    def init_kv_cache(self) -> None:
        self.worker.init_kv_cache()

    def execute(self, inputs: StepInputs) -> None:
        self.worker.run(inputs)       # what a step returns only rank 0 uses

    def call(self, message: WorkerCall) -> tuple[str, object]:
        try:
            return "ok", getattr(self.worker, message.method)(*message.args, **(message.kwargs or {}))
        except Exception:
            return "error", traceback.format_exc()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class RayGroup:
    """What the ranks share: their placement groups, and whether this engine started Ray."""
    placement_groups: list = field(default_factory=list)
    started_ray: bool = False


@dataclass
class RayRank:
    """Rank 0's handle on one actor: WorkerProcess's interface (send, answer, expect, check_alive,
    join, kill) over actor calls."""
    rank: int
    actor: object
    name: str
    node_id: str
    node_ip: str
    pid: int
    group: RayGroup
    pending: list = field(default_factory=list)    # refs of steps (and the cache's init) not yet seen done
    loading: object = None
    call_ref: object = None
    exited_cleanly: bool = False

    def _died(self, error: BaseException) -> RuntimeError:
        return RuntimeError(f"{self.name} (a Ray actor on node {self.node_id}, {self.node_ip}, pid {self.pid}) "
                            f"died: {str(error).splitlines()[0] if str(error) else type(error).__name__}; "
                            "this engine cannot continue, shut it down and start a new one")

    def _get(self, ref):
        import ray
        from ray.exceptions import RayActorError, RayTaskError
        try:
            return ray.get(ref)
        except RayActorError as error:
            raise self._died(error) from error
        except RayTaskError as error:
            raise RuntimeError(f"{self.name} failed:\n{error}") from error

    def check_alive(self) -> None:
        """Raise if a step or call sent to the actor has failed or found it dead."""
        import ray
        if self.pending:
            ready, self.pending = ray.wait(self.pending, num_returns=len(self.pending), timeout=0)
            for ref in ready:
                self._get(ref)
        for ref in (self.loading, self.call_ref):
            if ref is not None and ray.wait([ref], timeout=0)[0]:
                try:
                    self._get(ref)
                except RuntimeError:
                    if ref is self.loading:
                        self.loading = None
                    raise

    def join(self, timeout: float) -> None:
        import ray
        if self.pending:
            ray.wait(self.pending, num_returns=len(self.pending), timeout=timeout)

    def kill(self) -> None:
        import ray
        ray.kill(self.actor, no_restart=True)

    def send(self, message: StepInputs | WorkerCall) -> None:
        self.check_alive()
        if isinstance(message, WorkerCall):
            self.call_ref = self.actor.call.remote(message)
        else:
            self.pending.append(self.actor.execute.remote(message))

    def _wait(self, ref) -> None:
        import ray
        while not ray.wait([ref], timeout=0.05)[0]:
            self.check_alive()

    def answer(self) -> tuple[str, object]:
        """("ok", result) of the WorkerCall sent last, or ("error", the rank's traceback)."""
        ref, self.call_ref = self.call_ref, None
        self._wait(ref)
        return self._get(ref)

    def expect(self, message: str) -> None:
        """Wait for the actor's Worker to be built, then start its KV cache's set-up (a collective
        rank 0 joins next)."""
        assert message == LOADED
        ref = self.loading
        self._wait(ref)
        self.loading = None
        try:
            self._get(ref)
        except RuntimeError as error:
            if error.__cause__ is not None and "died" not in str(error):
                raise RuntimeError(f"{self.name} failed to start:\n{error.__cause__}") from error.__cause__
            raise
        self.pending.append(self.actor.init_kv_cache.remote())


def _bad(message: str) -> ValueError:
    return ValueError(f"distributed_executor_backend='ray': {message}")


def _check_cluster(config: Config, resource: str) -> None:
    """Enough GPUs (or CPUs) for every rank, and a node with enough for one tensor-parallel group."""
    import ray
    total = ray.cluster_resources().get(resource, 0)
    if total < config.world_size:
        raise _bad(f"the Ray cluster has {total:g} {resource}s but the engine has {config.world_size} ranks "
                   f"(tensor_parallel_size={config.tensor_parallel_size} x pipeline_parallel_size="
                   f"{config.pipeline_parallel_size}), one {resource} each")
    per_node = [node["Resources"].get(resource, 0) for node in ray.nodes() if node["Alive"]]
    if max(per_node, default=0) < config.tensor_parallel_size:
        raise _bad(f"no node of the Ray cluster has {config.tensor_parallel_size} {resource}s for one "
                   f"tensor-parallel group (a stage's ranks stay on one node); nodes have {per_node}")


def _place_stages(config: Config, resource: str) -> list:
    """One STRICT_PACK placement group per stage; stage 0's on this node (rank 0 runs here), held
    there by Ray's node-id label, and granted before the others are asked for (racing them, it could
    find this node's room taken)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    here = ray.get_runtime_context().get_node_id()
    groups = [placement_group([{resource: 1}] * tp, strategy="STRICT_PACK",
                              bundle_label_selector=[{"ray.io/node-id": here}] * tp)]
    ready, _ = ray.wait([groups[0].ready()], timeout=PLACEMENT_TIMEOUT_S)
    if ready:   # no room here: fail now, not after a second wait for the other stages
        groups += [placement_group([{resource: 1}] * tp, strategy="STRICT_PACK") for _ in range(pp - 1)]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=pp, timeout=PLACEMENT_TIMEOUT_S)
    if len(ready) < pp:
        for g in groups:
            remove_placement_group(g)
        raise RuntimeError(f"distributed_executor_backend='ray': Ray granted {len(ready)} of {pp} stages {tp} x "
                           f"{{{resource!r}: 1}} (the first on this node, {here}) within {PLACEMENT_TIMEOUT_S:g} s; "
                           f"available: {ray.available_resources()}")
    return groups


def start_ray_workers(config: Config, multi_token_len: int | None = None
                      ) -> tuple[dist.TCPStore, list[RayRank]]:
    """Ranks 1.. of `config`, each a RayWorker actor; and the store they meet rank 0 at, on this node's
    IP, reachable from the others (open_rendezvous). Checks the cluster before any weight is read."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    group = RayGroup(started_ray=not ray.is_initialized())
    if group.started_ray:
        ray.init(log_to_driver=False)
    try:
        resource = "GPU" if config.device == "cuda" else "CPU"
        _check_cluster(config, resource)
        group.placement_groups = _place_stages(config, resource)
        rendezvous = open_rendezvous(ray.util.get_node_ip_address())
        actor_class = ray.remote(RayWorker)
        tp, ranks = config.tensor_parallel_size, []
        for rank in range(1, config.world_size):
            stage, tp_rank = divmod(rank, tp)
            actor = actor_class.options(
                num_cpus=1 if resource == "CPU" else 0, num_gpus=1 if resource == "GPU" else 0,
                name=None, runtime_env={"env_vars": MULTICAST_OFF},   # actors do not inherit the driver's
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group.placement_groups[stage], placement_group_bundle_index=tp_rank)).remote()
            name = f"worker rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"
            ranks.append(RayRank(rank, actor, name, "?", "?", 0, group))
        for handle, (node_id, node_ip, pid) in zip(ranks, ray.get([r.actor.where.remote() for r in ranks])):
            handle.node_id, handle.node_ip, handle.pid = node_id, node_ip, pid
        for handle in ranks:
            handle.loading = handle.actor.load.remote(config, handle.rank, (rendezvous.host, rendezvous.port),
                                                      multi_token_len)
        return rendezvous, ranks
    except BaseException:
        for g in group.placement_groups:
            remove_placement_group(g)
        if group.started_ray:
            ray.shutdown()
        raise


def stop_ray_workers(ranks: list[RayRank]) -> None:
    """Close every actor's worker (waiting up to GRACEFUL_STOP_S), kill the actors, remove the
    placement groups (waiting, as long again, until Ray has: an engine started anew right after,
    as a recovery does, must find their resources free), and shut Ray down if the engine started it."""
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group
    if not ranks or not ray.is_initialized():
        return
    closing = {r.actor.close.remote(): r for r in ranks}
    done, _ = ray.wait(list(closing), num_returns=len(closing), timeout=GRACEFUL_STOP_S)
    for ref in done:
        try:
            ray.get(ref)
            closing[ref].exited_cleanly = True
        except Exception:
            pass
    for r in ranks:
        ray.kill(r.actor, no_restart=True)
    group = ranks[0].group
    for g in group.placement_groups:
        remove_placement_group(g)
    deadline = time.monotonic() + GRACEFUL_STOP_S
    while (any(placement_group_table(g)["state"] != "REMOVED" for g in group.placement_groups)
           and time.monotonic() < deadline):
        time.sleep(0.02)
    group.placement_groups = []
    if group.started_ray:
        ray.shutdown()
