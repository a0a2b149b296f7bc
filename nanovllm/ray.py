"""Data-parallel engine replicas on a Ray cluster: `RayLLM(model, num_replicas, **engine_args)`.

Each replica is a Ray actor holding one `LLMEngine`, placed by its own placement group on one node with
`tensor_parallel_size` GPUs (or CPUs on a cluster without GPUs). The driver tokenizes the prompts,
routes prompts that share their first block to the same replica (so its prefix cache is hit),
balances the rest by tokens, and streams outputs back in prompt order under one progress bar.
"""
import heapq
import os
import time
import warnings

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:     # an optional dependency: say how to get it
    raise ImportError("nanovllm.ray needs Ray: pip install 'nanovllm[ray]'") from e
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm.config import Config
from nanovllm.engine.input_processor import Prompt, encode_prompt, pair_prompts_with_params
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.validation import check_int, check_number

Request = tuple[list[int], SamplingParams]                    # token ids and how to sample them
# a replica's stream of finished outputs -> (that replica, the prompt indices it was given)
Streams = dict[ray.ObjectRefGenerator, tuple[int, list[int]]]

# After its first outputs, a replica sends what it finished at most this often, so the driver's
# bar moves without a Ray object per finished request.
REPORT_INTERVAL_S = 0.25
# How long `shutdown` lets replicas stop their engines (and tensor-parallel workers) before killing them.
GRACEFUL_STOP_S = 30.0


class EngineReplica:
    """One replica: an `LLMEngine` inside a Ray actor. Built empty so that a bad engine argument comes
    back from `load` as the engine's own ValueError or TypeError."""

    def __init__(self):
        self.engine: LLMEngine | None = None

    def load(self, model: str, engine_args: dict) -> Config:
        self.engine = LLMEngine(model, **engine_args)
        return self.engine.config

    def pid(self) -> int:
        return os.getpid()

    def generate(self, requests: list[tuple[int, list[int], SamplingParams]]):
        """Run (prompt index, token ids, params) requests; yields lists of (prompt index, output)
        as they finish. A cancelled call aborts the requests it leaves behind."""
        index_of = {self.engine.add_request(token_ids, params): index for index, token_ids, params in requests}
        finished: list[tuple[int, dict]] = []
        remaining, last_report = len(index_of), float("-inf")     # the first finished go at once
        try:
            while remaining:
                for output in self.engine.step():
                    index = index_of.pop(output["request_id"], None)
                    if index is not None:
                        finished.append((index, output))
                        remaining -= 1
                if finished and (not remaining or time.monotonic() - last_report >= REPORT_INTERVAL_S):
                    yield finished
                    finished, last_report = [], time.monotonic()
        finally:
            for request_id in index_of:
                self.engine.abort(request_id)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def route_prompts(prompts: list[list[int]], max_tokens: list[int], replicas: list[int],
                  prefix_length: int) -> list[int]:
    """The replica of each prompt. Prompts whose first `prefix_length` tokens are equal form a
    group that stays on one replica; groups go largest first to the least-loaded replica, a load
    being prompt plus max_tokens tokens. A group larger than a fair share (say, one long system
    prompt before every prompt) is cut into contiguous pieces, one replica each, so it does not
    serialize the job; each piece still hits its replica's prefix cache."""
    costs = [len(p) + m for p, m in zip(prompts, max_tokens)]
    groups: dict[object, list[int]] = {}
    for i, prompt in enumerate(prompts):
        key = tuple(prompt[:prefix_length]) if len(prompt) >= prefix_length else i
        groups.setdefault(key, []).append(i)
    fair_share = sum(costs) / len(replicas)
    pieces: list[list[int]] = []
    for members in groups.values():
        piece, piece_cost = [], 0
        for i in members:
            piece.append(i)
            piece_cost += costs[i]
            if piece_cost >= fair_share and len(replicas) > 1:
                pieces.append(piece)
                piece, piece_cost = [], 0
        if piece:
            pieces.append(piece)
    # largest first; ties keep first-seen order, so the plan is deterministic
    pieces.sort(key=lambda piece: -sum(costs[i] for i in piece))
    loads = [(0, r) for r in replicas]      # (tokens assigned, replica) as a min-heap
    route = [-1] * len(prompts)
    for piece in pieces:
        load, replica = heapq.heappop(loads)
        for i in piece:
            route[i] = replica
        heapq.heappush(loads, (load + sum(costs[i] for i in piece), replica))
    return route


class RayLLM:
    """`num_replicas` engine replicas on a Ray cluster behind the `LLM.generate` contract.

    address: a Ray cluster to join ("auto", "ray://host:10001", ...); by default `ray.init()` joins
    the cluster named by RAY_ADDRESS or one started by `ray start` on this machine, else starts a
    local one. Ray already initialised in this process is used as it is.
    prefix_length: prompts with these first tokens in common share a replica (default: the engine's
    `kvcache_block_size`, the smallest prefix the prefix cache can reuse).
    placement_timeout_s: how long to wait for the cluster to grant every replica's resources.
    ray_init_args: passed to `ray.init` when this object starts or joins Ray.
    """

    def __init__(self, model: str, num_replicas: int = 1, *, address: str | None = None,
                 prefix_length: int | None = None, placement_timeout_s: float = 300.0,
                 ray_init_args: dict | None = None, **engine_args):
        check_int("num_replicas", num_replicas, 1)
        if not os.path.isdir(os.path.expanduser(str(model))):
            raise ValueError(f"model must be a checkpoint directory (on the driver and on every node), got {model!r}")
        if prefix_length is None:
            prefix_length = engine_args.get("kvcache_block_size", Config.kvcache_block_size)
        check_int("prefix_length", prefix_length, 1)
        check_number("placement_timeout_s", placement_timeout_s, 0.0, low_open=True)
        check_int("tensor_parallel_size", engine_args.get("tensor_parallel_size", 1), 1)
        check_int("pipeline_parallel_size", engine_args.get("pipeline_parallel_size", 1), 1)
        if engine_args.get("distributed_executor_backend", "mp") != "mp":
            raise ValueError("distributed_executor_backend: a RayLLM replica runs its ranks as local processes "
                             f"('mp') on one node, got {engine_args['distributed_executor_backend']!r}")
        self.model = os.path.expanduser(str(model))
        self.prefix_length = prefix_length
        self.replicas: list = []                 # actor handles; None once a replica has died
        self.placement_groups: list[PlacementGroup] = []
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            ray.init(address=address, **(ray_init_args or {}))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model)
            engine_args = self._place_replicas(num_replicas, engine_args, placement_timeout_s)
            loading = [r.load.remote(self.model, engine_args) for r in self.replicas]
            for i, ref in enumerate(loading):
                try:
                    self.config = ray.get(ref)
                except RayActorError as error:
                    raise RuntimeError(f"replica {i} died while loading {self.model}: {error}") from error
        except BaseException:
            self.shutdown()
            raise

    def _place_replicas(self, num_replicas: int, engine_args: dict, timeout_s: float) -> dict:
        """Reserve one bundle per replica and start the actors; returns the engine args with the
        device settled. A replica is one process that spawns its tensor-parallel workers beside it,
        and Ray grants an actor's resources from a single bundle, which always lies on one node."""
        # a replica's ranks (tensor x pipeline) are processes beside it, on its node
        tp = engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
        device = engine_args.get("device", "auto")
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        bundle = {"CPU": tp, "GPU": tp} if device == "cuda" else {"CPU": tp}
        self.placement_groups = [placement_group([bundle], strategy="STRICT_PACK")
                                 for _ in range(num_replicas)]
        ready, _ = ray.wait([pg.ready() for pg in self.placement_groups], num_returns=num_replicas,
                            timeout=timeout_s)
        if len(ready) < num_replicas:
            raise RuntimeError(
                f"Ray granted {len(ready)} of {num_replicas} replicas {bundle} each within "
                f"placement_timeout_s={timeout_s}; cluster resources: {ray.cluster_resources()}, "
                f"available: {ray.available_resources()}")
        actor_class = ray.remote(EngineReplica)
        self.replicas = [
            actor_class.options(num_cpus=tp, num_gpus=tp if device == "cuda" else 0,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
            for pg in self.placement_groups]
        return {**engine_args, "device": device}

    # ---- routing -------------------------------------------------------------------------------

    def _alive(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r is not None]

    def _requests(self, prompts: list[Prompt], sampling_params) -> list[Request]:
        """Token ids and params of every prompt, checked the way `LLM.generate` checks them."""
        pairs = pair_prompts_with_params(prompts, sampling_params)
        for _, sp in pairs:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        return [(encode_prompt(self.tokenizer, self.config, p), sp) for p, sp in pairs]

    def route(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None
              ) -> list[int]:
        """The replica each prompt would go to in `generate` now (see `route_prompts`)."""
        requests = self._requests(prompts, sampling_params)
        return self._route(requests, list(range(len(requests))))

    def _route(self, requests: list[Request], indices: list[int]) -> list[int]:
        alive = self._alive()
        if not alive:
            raise RuntimeError("every replica has died; create a new RayLLM")
        return route_prompts([requests[i][0] for i in indices], [requests[i][1].max_tokens for i in indices],
                             alive, self.prefix_length)

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt over all replicas; outputs come back in prompt order, each with
        a `replica` key naming the replica that served it. If a replica dies, its unfinished prompts
        are retried on the others (with a warning); if none is left, a RuntimeError names it."""
        if not self.replicas:
            raise RuntimeError("this RayLLM has been shut down; create a new one")
        requests = self._requests(prompts, sampling_params)
        outputs: list[dict | None] = [None] * len(requests)
        running: Streams = {}
        bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        try:
            self._dispatch(requests, list(range(len(requests))), running)
            while running:
                bar.set_postfix_str(f"{len(self._alive())} replicas", refresh=False)
                [stream], _ = ray.wait(list(running), num_returns=1)
                replica, indices = running[stream]
                try:
                    finished = ray.get(next(stream))
                except StopIteration:
                    del running[stream]
                    continue
                except RayActorError as error:
                    del running[stream]
                    self._retry_elsewhere(replica, error, requests, indices, outputs, running)
                    continue
                except RayTaskError as error:
                    raise RuntimeError(f"replica {replica} failed: {error}") from error
                for index, output in finished:
                    outputs[index] = {**output, "replica": replica}
                bar.update(len(finished))
        finally:
            bar.close()
            for stream in running:          # an error or Ctrl-C: stop the other replicas' work
                ray.cancel(stream)
        return outputs

    def _dispatch(self, requests: list[Request], indices: list[int], running: Streams) -> None:
        by_replica: dict[int, list[int]] = {}
        for index, replica in zip(indices, self._route(requests, indices)):
            by_replica.setdefault(replica, []).append(index)
        for replica, mine in by_replica.items():
            stream = self.replicas[replica].generate.remote([(i, *requests[i]) for i in mine])
            running[stream] = (replica, mine)

    def _retry_elsewhere(self, replica: int, error: RayActorError, requests: list[Request], indices: list[int],
                         outputs: list[dict | None], running: Streams) -> None:
        """A replica died: drop it for good and send its unfinished prompts to the others."""
        ray.kill(self.replicas[replica], no_restart=True)      # in case it is only unreachable
        self.replicas[replica] = None
        # its other streams (a retry queued behind the one that failed) fail the same way
        for stream, (other, mine) in list(running.items()):
            if other == replica:
                del running[stream]
                indices = indices + mine
        unfinished = [i for i in indices if outputs[i] is None]
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        if not self._alive():
            raise RuntimeError(f"replica {replica} died ({cause}); no replica is left to retry its "
                               f"{len(unfinished)} unfinished prompts on") from error
        warnings.warn(f"replica {replica} died ({cause}); retrying its {len(unfinished)} unfinished "
                      f"prompts on replicas {self._alive()}", RuntimeWarning, stacklevel=3)
        if unfinished:
            self._dispatch(requests, unfinished, running)

    # ---- lifetime ------------------------------------------------------------------------------

    def replica_pids(self) -> list[int | None]:
        """The process id of each replica (None for a dead one), for monitoring."""
        alive = self._alive()
        pids = ray.get([self.replicas[i].pid.remote() for i in alive])
        found = dict(zip(alive, pids))
        return [found.get(i) for i in range(len(self.replicas))]

    def shutdown(self) -> None:
        """Stop every replica's engine, kill the actors, release their placement groups, and shut
        Ray down if this object started it. Safe to call twice."""
        alive = [r for r in self.replicas if r is not None]
        if alive:
            stopping = [r.shutdown.remote() for r in alive]
            ray.wait(stopping, num_returns=len(stopping), timeout=GRACEFUL_STOP_S)
        for replica in alive:
            ray.kill(replica, no_restart=True)
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.replicas, self.placement_groups = [], []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = False

    def __enter__(self) -> "RayLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
