"""distributed_executor_backend="ray": ranks 1.. as Ray actors on a local two-node cluster that this
module starts (ray.cluster_utils.Cluster: two nodes of 2 CPUs each), judged against the "mp"
backend's, or one stage's, greedy tokens and logprobs on the same tiny model, with the node each rank
ran on; a killed actor; shutdown; bad values."""
import contextlib
import os
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from nanovllm import LLM
from nanovllm.executor.processes import MULTICAST_OFF
from tests.test_tensor_parallel import process_environment, SamplingParams  # noqa: E402
from nanovllm.checkpoints.random_checkpoint import write_tiny_model  # noqa: E402
from tests.test_ray import wait_until_gone  # noqa: E402
from tests.test_pipeline_parallel import assert_same, generate_twice  # noqa: E402
import nanovllm.executor.executor as executor_module  # noqa: E402
import nanovllm.executor.ray_processes as ray_processes  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU actors")

ARGS = dict(device="cpu", kvcache_block_size=16, max_model_len=128, max_num_batched_tokens=32,
            max_num_seqs=4, num_kvcache_blocks=24)
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
PROMPTS = [[5, 6, 7], list(range(10, 50)), [3] * 17, [100, 200, 300, 400, 8]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("ray_pp")), seed=4, num_hidden_layers=4)


@pytest.fixture(scope="module")
def nodes():
    """(head node id, second node id) of a cluster this module starts and this driver joins."""
    assert not ray.is_initialized(), "these tests start their own local Ray cluster"
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, include_dashboard=False))
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root, "OMP_NUM_THREADS": "1"}})
    head = ray.get_runtime_context().get_node_id()
    [second] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    yield head, second
    ray.shutdown()
    cluster.shutdown()


@contextlib.contextmanager
def one_head_cpu_taken(head: str):
    """Hold one of the head's two CPUs, so two one-CPU stages must sit on different nodes."""
    holder = ray.remote(num_cpus=1)(type("Holder", (), {"ping": lambda self: 1}))
    actor = holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
    ray.get(actor.ping.remote())
    try:
        yield
    finally:
        ray.kill(actor)


@contextlib.contextmanager
def one_rank_placement_recorded():
    """{rank: node id} of every Ray actor rank the engines started in the block (each actor's answer
    to where(), asked before it loads)."""
    placed, start = {}, ray_processes.start_ray_workers

    def start_and_record(*args, **kwargs):
        rendezvous, ranks = start(*args, **kwargs)
        placed.update((r.rank, r.node_id) for r in ranks)
        return rendezvous, ranks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(executor_module, "start_ray_workers", start_and_record)
        yield placed


def outputs(llm: LLM) -> list:
    return [(o["token_ids"], o["logprobs"]) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def ranks_of(llm: LLM) -> list:
    return llm.engine.core.executor.processes


def wait_for_cpus(expected: float, timeout_s: float = 20.0) -> float:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0)


def test_two_stages_on_two_nodes_match_mp(model, nodes):
    head, second = nodes
    with LLM(model, pipeline_parallel_size=2, **ARGS) as llm:
        expected = [outputs(llm), outputs(llm)]       # the second run hits the prefix cache
    with one_head_cpu_taken(head):
        with LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ARGS) as llm:
            [rank1] = ranks_of(llm)
            assert ray.get(rank1.actor.where.remote())[0] == second, "stage 1 sits on the other node"
            assert rank1.node_id == second
            assert MULTICAST_OFF.items() <= process_environment(rank1.pid).items()    # NVLS stays off there too
            assert [outputs(llm), outputs(llm)] == expected
            pid = rank1.pid
        # shutdown: the actor is gone, its placement groups removed, every CPU free again
        assert wait_until_gone([pid]) == []
        assert all(entry["state"] == "REMOVED" for entry in placement_group_table().values())
        assert wait_for_cpus(3) == 3       # four CPUs, one held by the holder


def test_tensor_parallel_group_on_one_node_matches_mp(model, nodes):
    head, _ = nodes
    with LLM(model, tensor_parallel_size=2, **ARGS) as llm:
        expected = outputs(llm)
    with LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", **ARGS) as llm:
        [rank1] = ranks_of(llm)
        assert rank1.node_id == head, "a tensor-parallel group stays on the node of rank 0"
        assert outputs(llm) == expected
        pid = rank1.pid
    assert wait_until_gone([pid]) == []
    assert wait_for_cpus(4) == 4


def test_two_stages_of_two_tensor_parallel_ranks_each_on_its_node_match_one_stage(model, nodes):
    """The layout the backend is for: a tensor-parallel group per node, a stage per group. Tokens
    and logprobs equal one stage's under chunked prefill, preemption and prefix-cache hits."""
    head, second = nodes
    expected, _ = generate_twice(model, device="cpu")
    with one_rank_placement_recorded() as placed:
        got, preemptions = generate_twice(model, device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2,
                                          distributed_executor_backend="ray")
    assert placed == {1: head, 2: second, 3: second}, "stage 0 with rank 0, stage 1 on the other node"
    assert preemptions > 0
    for run in range(2):
        assert_same(got[run], expected[run], 2e-4)
    assert wait_for_cpus(4) == 4


def test_three_stages_on_an_uneven_split_over_two_nodes_match_one_stage(model, nodes):
    head, second = nodes
    expected, _ = generate_twice(model, device="cpu")
    with one_head_cpu_taken(head), one_rank_placement_recorded() as placed:
        got, preemptions = generate_twice(model, device="cpu", pipeline_parallel_size=3,
                                          distributed_executor_backend="ray")
        assert placed == {1: second, 2: second}, "the head's one free CPU is rank 0's"
    assert preemptions > 0
    for run in range(2):
        assert_same(got[run], expected[run], 2e-4)
    assert wait_for_cpus(4) == 4


def test_a_killed_actor_is_an_error_naming_its_rank_and_node(model, nodes):
    head, second = nodes
    with one_head_cpu_taken(head):
        llm = LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ARGS)
        try:
            [rank1] = ranks_of(llm)
            outputs(llm)
            ray.kill(rank1.actor)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=f"worker rank 1 .*node {second}.* died"):
                outputs(llm)
            assert time.monotonic() - start < 120, "an error, not a hang"
        finally:
            llm.shutdown()
        assert all(entry["state"] == "REMOVED" for entry in placement_group_table().values())
        assert wait_for_cpus(3) == 3


def test_no_room_on_this_node_is_an_error_after_one_wait(model, nodes, monkeypatch):
    """Both head CPUs held: stage 0 (rank 0's node) cannot be placed, so the other stages are not
    asked for and the error comes after one PLACEMENT_TIMEOUT_S, with every group removed."""
    head, _ = nodes
    monkeypatch.setattr(ray_processes, "PLACEMENT_TIMEOUT_S", 4.0)
    with one_head_cpu_taken(head), one_head_cpu_taken(head):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"Ray granted 0 of 2 stages .*the first on this node, {head}"):
            LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ARGS)
        assert time.monotonic() - start < 8, "one wait, not one per round of stages"
        assert all(entry["state"] == "REMOVED" for entry in placement_group_table().values())
    assert wait_for_cpus(4) == 4


@pytest.mark.parametrize("engine_args, message", [
    (dict(distributed_executor_backend="threads"), "distributed_executor_backend must be 'mp' or 'ray'"),
    (dict(distributed_executor_backend="ray", tensor_parallel_size=2, pipeline_parallel_size=3),
     "distributed_executor_backend='ray': the Ray cluster has 4 CPUs but the engine has 6 ranks"),
    (dict(distributed_executor_backend="ray", tensor_parallel_size=4),
     r"distributed_executor_backend='ray': no node of the Ray cluster has 4 CPUs for one tensor-parallel group"),
])
def test_bad_values_name_the_argument(model, nodes, engine_args, message, monkeypatch):
    import nanovllm.executor.executor as executor_module

    def no_worker(*args, **kwargs):
        raise AssertionError("a Worker was built (weights read) before the bad value was refused")
    monkeypatch.setattr(executor_module, "Worker", no_worker)
    with pytest.raises(ValueError, match=message):
        LLM(model, **{**ARGS, **engine_args})
    assert wait_for_cpus(4) == 4, "a refused engine reserves nothing"


def test_ray_not_installed_is_a_value_error(model, nodes, monkeypatch):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    with pytest.raises(ValueError, match="distributed_executor_backend='ray' needs Ray"):
        LLM(model, pipeline_parallel_size=2, distributed_executor_backend="ray", **ARGS)


def test_ray_llm_replicas_are_local_groups(model, nodes):
    from nanovllm.ray import RayLLM
    with pytest.raises(ValueError, match="distributed_executor_backend: a RayLLM replica runs its ranks"):
        RayLLM(model, num_replicas=1, distributed_executor_backend="ray", **ARGS)
    # a replica of two stages reserves both ranks' CPUs (one bundle: on one node)
    with RayLLM(model, num_replicas=1, pipeline_parallel_size=2, **ARGS) as llm:
        assert ray.available_resources().get("CPU", 0) == 2
        got = [(o["token_ids"], o["logprobs"]) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    with LLM(model, pipeline_parallel_size=2, **ARGS) as reference:
        assert got == outputs(reference)
    assert wait_for_cpus(4) == 4
