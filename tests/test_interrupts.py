"""Whatever interrupts the engine loop (an exception or Ctrl-C at any point of a step), the engine
ends consistent: the interrupted call's requests are gone with their blocks, the prefix cache holds
no stale entry, other requests carry on, and the next call's tokens equal transformers' greedy ones."""
import os
import random
import signal
import threading

import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = mixed_prompts(500, lengths=(40, 3, 21, 17, 9), seed=11)


class Injected(Exception):
    pass


def assert_consistent(llm: LLM) -> None:
    """Every block's reference count equals the number of live block tables that hold it; free
    blocks are exactly those with no holder; every hash entry names a block carrying that hash."""
    bm = llm.engine.core.scheduler.block_manager
    sched = llm.engine.core.scheduler
    assert not set(map(id, sched.running)) & set(map(id, sched.waiting))
    holders = [0] * len(bm.blocks)
    for seq in list(sched.running) + list(sched.waiting):
        assert not seq.is_finished
        for block_id in seq.block_table:
            holders[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == holders
    free = set(bm.empty_blocks) | set(bm.evictable_blocks)
    assert len(free) == len(bm.empty_blocks) + len(bm.evictable_blocks)
    assert free == {i for i, n in enumerate(holders) if n == 0}
    for block_hash, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == block_hash
    assert all(bm.blocks[b].hash is not None for b in bm.evictable_blocks)
    live = {seq.request_id for seq in list(sched.running) + list(sched.waiting)}
    assert live <= set(llm.engine.core.requests)


def assert_idle_and_correct(llm: LLM, hf_greedy, prompts=PROMPTS) -> None:
    assert_consistent(llm)
    assert llm.engine.is_finished() and llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(llm.config.model, p, 12) for p in prompts]
    assert_consistent(llm)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def fail_on_call(obj, name: str, k: int, error: type[BaseException], after: bool = False):
    """Make obj.name raise `error` on its k-th call (before it runs, or after it returned)."""
    original = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k and not after:
            raise error("injected")
        result = original(*args, **kwargs)
        if calls[0] == k and after:
            raise error("injected")
        return result

    setattr(obj, name, wrapper)


def failing_progress_bar(k: int, error):
    """A tqdm stand-in whose k-th update raises."""
    class Bar:
        calls = 0

        def __init__(self, *args, **kwargs):
            pass

        def update(self, n):
            Bar.calls += 1
            if Bar.calls == k:
                raise error("injected")

        def set_postfix_str(self, *args, **kwargs):
            pass

        def close(self):
            pass
    return Bar


def restore(obj, name):
    if name in vars(obj):
        delattr(obj, name)


# Where the loop can be interrupted: (object to patch, attribute, call number, after the call)
def injection_points(llm):
    runner, sched = llm.engine.core.executor, llm.engine.core.scheduler
    model = runner.driver.model.model
    layer = model.layers[model.end_layer - 1].mlp      # the last layer rank 0 holds (all, without stages)
    return {
        "scheduling": (sched, "schedule", 4, False),
        "launch": (runner, "launch", 3, False),
        # with CUDA graphs, decode steps replay a graph instead of calling the layers
        "forward pass": (runner.driver.graphs, "replay", 3, False) if runner.driver.graphs else (layer, "forward", 5, False),
        "waiting for tokens": (runner, "collect", 4, False),
        "after the tokens came": (sched, "fill", 3, True),
        "stop strings": (llm.engine.core, "finds_stop", 6, False),
    }


@pytest.fixture(scope="module")
def llm(model_paths):
    return LLM(model_paths["gqa_tied"], kvcache_block_size=16, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.mark.parametrize("error", [KeyboardInterrupt, Injected])
@pytest.mark.parametrize("point", ["scheduling", "launch", "forward pass", "waiting for tokens",
                                   "after the tokens came", "stop strings", "progress bar"])
def test_interrupted_generate_leaves_a_consistent_engine(llm, hf_greedy, point, error, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["never appears\x00"])
    if point == "progress bar":
        monkeypatch.setattr("nanovllm.llm.tqdm", failing_progress_bar(2, error))
    else:
        obj, name, k, after = injection_points(llm)[point]
        fail_on_call(obj, name, k, error, after)
    try:
        with pytest.raises(error):
            llm.generate(PROMPTS, params)
    finally:
        if point != "progress bar":
            restore(obj, name)
    assert_idle_and_correct(llm, hf_greedy)


def test_other_requests_survive_an_interrupted_generate(llm, hf_greedy):
    """A request added with add_request keeps running through another call's interruption; its
    output comes from a later step() (once), or from the interrupted call's steps if it finished."""
    mine = llm.engine.add_request(PROMPTS[0], GREEDY)
    fail_on_call(llm.engine.core.executor, "collect", 3, KeyboardInterrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    finally:
        restore(llm.engine.core.executor, "collect")
    assert_consistent(llm)
    outputs = []
    while not llm.engine.is_finished():
        outputs += llm.engine.step()
    assert [o["request_id"] for o in outputs] == [mine]
    assert outputs[0]["token_ids"] == hf_greedy(llm.config.model, PROMPTS[0], 12)
    assert llm.engine.step() == [] and llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_request_finishing_during_generate_is_returned_by_step(llm, hf_greedy):
    short = llm.engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    long = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    assert long["token_ids"] == hf_greedy(llm.config.model, PROMPTS[2], 12)
    assert not llm.engine.is_finished()                       # its output waits to be returned
    outputs = llm.engine.step()
    assert [o["request_id"] for o in outputs] == [short]
    assert outputs[0]["token_ids"] == hf_greedy(llm.config.model, PROMPTS[1], 2)
    assert llm.engine.is_finished() and llm.engine.step() == []


def interrupt_each_point_with_ranks(llm, prompts, params, greedy, expected, monkeypatch=None) -> None:
    """Each point of the loop of an engine of several ranks interrupted in turn (with monkeypatch,
    the progress bar too, and every generate shows one): a failure in rank 0's forward pass, after
    the others got the step, starts them anew, nothing else does; each time the engine ends
    consistent, idle and holding no block, and its next greedy tokens are `expected`."""
    points = [("scheduling", KeyboardInterrupt), ("forward pass", Injected), ("forward pass", KeyboardInterrupt),
              ("waiting for tokens", KeyboardInterrupt), ("stop strings", Injected)]
    if monkeypatch is not None:
        points.append(("progress bar", KeyboardInterrupt))
    for point, error in points:
        ranks = [p.process.pid for p in llm.engine.core.executor.processes]
        if point == "progress bar":
            monkeypatch.setattr("nanovllm.llm.tqdm", failing_progress_bar(1, error))
        else:
            obj, name, k, after = injection_points(llm)[point]
            fail_on_call(obj, name, k, error, after)
        try:
            with pytest.raises(error):
                llm.generate(prompts, params, use_tqdm=monkeypatch is not None)
        finally:
            if point == "progress bar":
                monkeypatch.undo()
            else:
                restore(obj, name)
        restarted = ranks != [p.process.pid for p in llm.engine.core.executor.processes]
        assert restarted == (point == "forward pass"), point
        assert_consistent(llm)
        assert llm.engine.is_finished() and llm.engine.core.scheduler.block_manager.num_used_blocks == 0
        assert [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected, point


def generate_until_ctrl_c(llm, prompts, params, delay: float) -> None:
    """Generate again and again until a real SIGINT, sent after delay seconds, lands somewhere.
    Python's own handler is installed for the while: a shell that starts the tests in the
    background (`cmd &`) hands them SIGINT ignored, and the loop would never end."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        while True:
            llm.generate(prompts, params, use_tqdm=False)
    except KeyboardInterrupt:
        pass
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_from_a_signal_mid_generate(llm, hf_greedy):
    """A real SIGINT lands wherever the loop is; several tries land in several places."""
    long_run = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    for delay in (0.05, 0.2, 0.45):
        generate_until_ctrl_c(llm, PROMPTS * 4, long_run, delay)
        assert_consistent(llm)
        assert llm.engine.is_finished() and llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    assert_idle_and_correct(llm, hf_greedy)


def test_abort_frees_blocks_at_once_also_in_flight(llm, hf_greedy):
    ids = [llm.engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    llm.engine.step()                                          # prefill launched, tokens still pending
    llm.engine.step()                                          # a decode step in flight
    assert ids[1] in {s.request_id for step in llm.engine.core.in_flight for s in step.seqs}
    held = len(llm.engine.core.requests[ids[1]].block_table)
    used = llm.engine.core.scheduler.block_manager.num_used_blocks
    assert llm.engine.abort(ids[1]) and not llm.engine.abort(ids[1])
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == used - held
    assert_consistent(llm)
    outputs = []
    while not llm.engine.is_finished():
        outputs += llm.engine.step()
    assert sorted(o["request_id"] for o in outputs) == [ids[0], ids[2]]
    for o in outputs:
        assert o["token_ids"] == hf_greedy(llm.config.model, PROMPTS[ids.index(o["request_id"])], 12)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_random_interleavings_keep_every_invariant(llm, hf_greedy):
    """Random add_request / step / generate / interrupts / aborts / bad inputs: after each, the pool
    and the queues are consistent; at the end every request not aborted was returned exactly once,
    with transformers' tokens."""
    rng = random.Random(5)
    path = llm.config.model
    prompts = mixed_prompts(500, lengths=(5, 18, 33, 2, 26, 40), seed=12)
    expected = {i: hf_greedy(path, p, 6) for i, p in enumerate(prompts)}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt_of, delivered, aborted = {}, [], set()
    targets = [(llm.engine.core.executor, "collect"), (llm.engine.core.executor, "launch"), (llm.engine.core.scheduler, "schedule"),
               (llm.engine.core.scheduler, "fill")]
    for _ in range(60):
        action = rng.choice(["add", "add", "step", "step", "step", "generate", "interrupt", "abort", "bad"])
        if action == "add":
            i = rng.randrange(len(prompts))
            prompt_of[llm.engine.add_request(prompts[i], params)] = i
        elif action == "step":
            delivered += [(o["request_id"], o) for o in llm.engine.step()]
        elif action == "generate":
            picks = rng.sample(range(len(prompts)), 2)
            outs = llm.generate([prompts[i] for i in picks], params, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == [expected[i] for i in picks]
        elif action == "interrupt":
            obj, name = rng.choice(targets)
            fail_on_call(obj, name, rng.randint(1, 3), rng.choice([KeyboardInterrupt, Injected]),
                         after=rng.random() < 0.5)
            picks = rng.sample(range(len(prompts)), 2)
            try:
                outs = llm.generate([prompts[i] for i in picks], params, use_tqdm=False)
                assert [o["token_ids"] for o in outs] == [expected[i] for i in picks]
            except (KeyboardInterrupt, Injected):
                pass
            finally:
                restore(obj, name)
        elif action == "abort" and prompt_of:
            request_id = rng.choice(sorted(prompt_of))
            if request_id not in aborted and request_id not in dict(delivered):
                assert llm.engine.abort(request_id)
                aborted.add(request_id)
        elif action == "bad":
            bad = rng.choice([SamplingParams(stop_token_ids=[10**6]), SamplingParams(top_p=0.5)])
            if bad.top_p == 0.5:
                bad.top_p = 7.0                          # changed after construction
            with pytest.raises(ValueError):
                llm.engine.add_request(prompts[0], bad)
        assert_consistent(llm)
    while not llm.engine.is_finished():
        delivered += [(o["request_id"], o) for o in llm.engine.step()]
        assert_consistent(llm)
    ids = [request_id for request_id, _ in delivered]
    assert len(ids) == len(set(ids))                      # exactly once
    assert set(ids) == set(prompt_of) - aborted           # every request not aborted
    for request_id, out in delivered:
        assert out["token_ids"] == expected[prompt_of[request_id]]
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


# ---- input holes -------------------------------------------------------------------------------

def test_stop_token_outside_vocabulary_is_rejected(llm, hf_greedy):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([PROMPTS[0]], SamplingParams(min_tokens=2, stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(stop_token_ids=[llm.config.hf_config.vocab_size]))
    assert_idle_and_correct(llm, hf_greedy, PROMPTS[:2])


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_temperature_must_be_finite(value):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)


def test_tiny_temperature_is_greedy(llm, hf_greedy):
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=1e-40, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(llm.config.model, PROMPTS[0], 12)


def test_huge_top_k_is_the_whole_vocabulary(llm):
    """top_k beyond the vocabulary keeps every token (it once overflowed and masked them all, giving
    token 0 at every step): the same seeded tokens as top_k = vocabulary size."""
    def seeded(top_k):
        return SamplingParams(temperature=1.0, top_k=top_k, seed=3, max_tokens=12, ignore_eos=True)
    huge = llm.generate([PROMPTS[0]], seeded(2**63), use_tqdm=False)[0]["token_ids"]
    vocab = llm.generate([PROMPTS[0]], seeded(llm.config.hf_config.vocab_size), use_tqdm=False)[0]["token_ids"]
    assert huge == vocab
    assert len(set(huge)) > 1 and huge != [0] * 12


def test_sampling_params_changed_after_construction_are_checked_again(llm):
    params = SamplingParams(temperature=0.5)
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.engine.add_request(PROMPTS[0], params)
    params = SamplingParams()
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert llm.engine.is_finished()


def test_add_request_on_a_shut_down_engine_raises(model_paths):
    from nanovllm.engine.llm_engine import LLMEngine
    engine = LLMEngine(model_paths["gqa_tied"], kvcache_block_size=16)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request([5, 6], GREEDY)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()


def test_duplicate_request_id_is_rejected(llm):
    llm.engine.add_request([5, 6], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="request_id"):
        llm.engine.add_request([7, 8], GREEDY, request_id="a")
    assert llm.engine.abort("a") and llm.engine.is_finished()
