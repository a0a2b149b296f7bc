"""Data-parallel replicas on a local Ray cluster, judged against one in-process LLM.

The cluster is started once for the module by the first RayLLM (Ray start-up and each replica's
torch import take seconds on a small machine); the last test shuts it down and checks that nothing
of ours is left running.
"""
import os
import subprocess
import time

import pytest

ray = pytest.importorskip("ray")

import nanovllm.ray as nanovllm_ray
from nanovllm import LLM, SamplingParams
from nanovllm.ray import RayLLM, route_prompts

ENGINE_ARGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=256, max_num_seqs=2)
CLUSTER = dict(num_cpus=4, include_dashboard=False, log_to_driver=False)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SHARED = "An inference engine turns a trained language model into answers. It keeps the keys and values"
PROMPTS = [
    "Introduce yourself.",
    SHARED + " of every token it has seen",
    "List all prime numbers within 100.",
    SHARED + " in a cache split into fixed-size blocks",
    "What is the capital of France?",
    "The scheduler decides at every step which requests run",
    SHARED + " so that many requests can share",
    "Tell me a story about a small robot who learns to read.",
]
SHARED_INDICES = [1, 3, 6]


def comparable(output: dict) -> tuple:
    return output["token_ids"], output["text"], output["prompt_token_ids"], output["finish_reason"]


def processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid -> (parent pid, command line); zombies count as gone."""
    listing = subprocess.run(["ps", "-eo", "pid=,ppid=,stat=,args="], capture_output=True, text=True,
                             check=True).stdout
    table = {}
    for line in listing.splitlines():
        pid, ppid, stat, *args = line.split(None, 3)
        if not stat.startswith("Z"):
            table[int(pid)] = (int(ppid), " ".join(args))
    return table


def wait_until_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    """The pids still running after waiting up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if p in processes()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def model(model_paths) -> str:
    return model_paths["gqa_tied"]


@pytest.fixture(scope="module")
def single(model):
    llm = LLM(model, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def replicas(model):
    assert not ray.is_initialized(), "these tests start their own local Ray cluster"
    llm = RayLLM(model, num_replicas=2, address="local", ray_init_args=CLUSTER, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


# ---- routing, without Ray ------------------------------------------------------------------------

def test_route_keeps_a_shared_prefix_together():
    shared = [5] * 16
    prompts = [shared + [1], [7] * 20, shared + [2, 3], [8] * 3, shared]
    route = route_prompts(prompts, [10] * 5, [0, 1], prefix_length=16)
    assert route[0] == route[2] == route[4]
    assert set(route) == {0, 1}


def test_route_is_largest_first_to_the_least_loaded():
    # costs 10, 7, 5, 4 (no shared prefix): 10 -> 0, 7 -> 1, 5 -> 1 (7 < 10), 4 -> 0 (10 < 12)
    prompts = [[1] * 6, [2] * 3, [3] * 1, [4] * 2]
    assert route_prompts(prompts, [4, 4, 4, 2], [0, 1], prefix_length=16) == [0, 1, 1, 0]
    assert route_prompts(prompts, [4, 4, 4, 2], [3, 5], prefix_length=16) == [3, 5, 5, 3]
    assert route_prompts(prompts, [4, 4, 4, 2], [2], prefix_length=16) == [2] * 4


def test_route_cuts_a_group_larger_than_a_fair_share():
    # one system prompt before every prompt must not put the whole job on one replica
    prompts = [[9] * 16 + [i] for i in range(6)]
    route = route_prompts(prompts, [8] * 6, [0, 1, 2], prefix_length=16)
    assert sorted(route) == [0, 0, 1, 1, 2, 2]
    assert route[0] == route[1] and route[2] == route[3] and route[4] == route[5]   # contiguous pieces


# ---- generation ----------------------------------------------------------------------------------

def test_replicas_match_one_llm_in_prompt_order(replicas, single):
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    outputs = replicas.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [comparable(o) for o in outputs] == [comparable(o) for o in expected]
    assert {o["replica"] for o in outputs} == {0, 1}, "both replicas should take work"
    route = replicas.route(PROMPTS, GREEDY)
    assert [o["replica"] for o in outputs] == route
    assert len({route[i] for i in SHARED_INDICES}) == 1, "prompts with a shared prefix go to one replica"


def test_per_prompt_params_and_token_id_prompts(replicas, single):
    prompts = [single.tokenizer.encode(p) for p in PROMPTS[:5]]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 9, 1, 6, 4)]
    expected = single.generate(prompts, params, use_tqdm=False)
    outputs = replicas.generate(prompts, params, use_tqdm=False)
    assert [comparable(o) for o in outputs] == [comparable(o) for o in expected]
    assert [len(o["token_ids"]) for o in outputs] == [len(o["token_ids"]) for o in expected]


def test_a_shared_prefix_is_read_from_its_replicas_cache(replicas):
    # max_num_seqs=2: a replica admits its third prompt in a later step than the first two, so
    # the prefix they computed is there to be read, if the three prompts went to the same replica.
    prefix = "Requests that begin with the same words share the same blocks. When a request finishes, its"
    assert len(replicas.tokenizer.encode(prefix)) >= 16
    grouped = [prefix + " blocks wait", prefix + " memory is taken", prefix + " list grows"]
    prompts = [grouped[0], "one", grouped[1], "two words", "three more words", grouped[2], "four"]
    outputs = replicas.generate(prompts, GREEDY, use_tqdm=False)
    served = [o for o in outputs if o["prompt_token_ids"][:16] == outputs[0]["prompt_token_ids"][:16]]
    assert len(served) == 3 and len({o["replica"] for o in served}) == 1
    assert max(o["num_cached_tokens"] for o in served) >= 16, [o["num_cached_tokens"] for o in served]


def test_bad_prompt_is_refused_before_any_work(replicas, single):
    too_long = [5] * 1100
    with pytest.raises(ValueError, match="empty"):
        replicas.generate(["fine", ""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        replicas.generate(["fine", too_long], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        replicas.generate(["fine"], [{"max_tokens": 3}], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        replicas.generate(["a", "b"], [GREEDY], use_tqdm=False)
    # still usable, and nothing of the refused calls is left in the replicas' engines
    assert comparable(replicas.generate(["fine"], GREEDY, use_tqdm=False)[0]) == \
        comparable(single.generate(["fine"], GREEDY, use_tqdm=False)[0])


def test_bad_arguments_name_themselves(model, replicas):
    with pytest.raises(ValueError, match="num_replicas"):
        RayLLM(model, num_replicas=0, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="model must be a checkpoint directory"):
        RayLLM(str(model) + "-missing", num_replicas=1, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="prefix_length"):
        RayLLM(model, num_replicas=1, prefix_length=0, **ENGINE_ARGS)
    free_cpus = ray.available_resources().get("CPU", 0)
    # an engine argument is checked by the engine inside the replica: its own error comes back
    with pytest.raises(ValueError, match="max_num_seqs"):
        RayLLM(model, num_replicas=1, **{**ENGINE_ARGS, "max_num_seqs": 0})
    # more than the cluster can grant: a clear error after placement_timeout_s, not a hang
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="placement_timeout_s"):
        RayLLM(model, num_replicas=int(free_cpus) + 1, placement_timeout_s=1.0, **ENGINE_ARGS)
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 10      # the failed attempts gave back what they reserved
    while ray.available_resources().get("CPU", 0) != free_cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == free_cpus


# ---- a replica dies --------------------------------------------------------------------------------

def kill_once_output_arrives(monkeypatch, victim, index: int):
    """Kill `victim` (an actor) as soon as the driver has received the output of request `index`
    (which it keeps): on a loaded machine the other replica's outputs may come first."""
    killed = []

    class RayKillingOnOutput:
        def __getattr__(self, name):
            return getattr(ray, name)

        def get(self, refs, *args, **kwargs):
            result = ray.get(refs, *args, **kwargs)
            if not killed and isinstance(result, list) and any(isinstance(item, tuple) and item[:1] == (index,)
                                                              for item in result):
                ray.kill(victim)
                killed.append(victim)
            return result
    monkeypatch.setattr(nanovllm_ray, "ray", RayKillingOnOutput())


def test_dead_replica_work_is_retried_then_the_last_death_is_named(model, single, replicas, monkeypatch):
    # Longer prompts, so the victim is killed mid-run; one short request on the victim finishes
    # first, its arrival triggers the kill, and it must be kept. Its other prompts are retried on the survivor.
    long_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompts = PROMPTS
    with RayLLM(model, num_replicas=2, **{**ENGINE_ARGS, "max_num_seqs": 16}) as llm:
        assert not llm.started_ray       # joined the module's cluster
        pids = llm.replica_pids()
        params = [long_params] * len(prompts)
        params[0] = short_params
        route = llm.route(prompts, params)
        victim = route[0]
        assert route.count(victim) > 1, "the victim must have unfinished work when it dies"
        expected = single.generate(prompts, params, use_tqdm=False)

        kill_once_output_arrives(monkeypatch, llm.replicas[victim], 0)
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=f"replica {victim} died .* retrying its .* on replicas \\[{1 - victim}\\]"):
            outputs = llm.generate(prompts, params)
        assert time.monotonic() - start < 120
        assert [comparable(o) for o in outputs] == [comparable(o) for o in expected]
        assert outputs[0]["replica"] == victim, "work the victim finished before dying is kept"
        assert all(o["replica"] == 1 - victim for o in outputs[1:])
        assert wait_until_gone([pids[victim]]) == []

        # the survivor carries on alone; when it dies too, the error names it
        survivor = 1 - victim
        assert [comparable(o) for o in llm.generate(prompts, params, use_tqdm=False)] == \
            [comparable(o) for o in expected]
        kill_once_output_arrives(monkeypatch, llm.replicas[survivor], 0)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"replica {survivor} died .*no replica is left"):
            llm.generate(prompts, params)
        assert time.monotonic() - start < 120
        with pytest.raises(RuntimeError, match="every replica has died"):
            llm.generate(prompts, params, use_tqdm=False)
    assert wait_until_gone(pids) == []


# ---- last: shutdown ----------------------------------------------------------------------------------

def ray_processes_of_ours() -> list[str]:
    """Command lines of our descendant processes that belong to Ray (cluster daemons, workers)."""
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    descendants, frontier = [], [os.getpid()]
    while frontier:
        frontier = [child for pid in frontier for child in children.get(pid, [])]
        descendants += frontier
    return [table[pid][1] for pid in descendants if "ray" in table[pid][1]]


def test_shutdown_leaves_nothing_running(replicas):
    pids = replicas.replica_pids()
    assert replicas.started_ray and ray_processes_of_ours(), "the module's cluster runs under this process"
    replicas.shutdown()
    assert not ray.is_initialized()
    assert wait_until_gone(pids) == []
    deadline = time.monotonic() + 20
    while ray_processes_of_ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_processes_of_ours() == []
    with pytest.raises(RuntimeError, match="shut down"):
        replicas.generate(["hello"], GREEDY, use_tqdm=False)
    replicas.shutdown()        # a second call is harmless
