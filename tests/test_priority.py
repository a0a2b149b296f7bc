"""Request priority end to end: the scheduling order changes, greedy outputs do not (the scheduler's
own order and preemption tests are in test_scheduler.py)."""
import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PRIORITIES = [3, 1, 2, 1, 0]


def finishing_order(llm: LLM, prompts: list[list[int]], priorities: list[int]) -> tuple[list, dict]:
    """Add every request, then step to the end: request ids in the order they finished, and outputs."""
    ids = [llm.engine.add_request(prompt, GREEDY, priority=p) for prompt, p in zip(prompts, priorities)]
    order, outputs = [], {}
    while not llm.engine.is_finished():
        for out in llm.engine.step():
            order.append(ids.index(out["request_id"]))
            outputs[ids.index(out["request_id"])] = out["token_ids"]
    return order, outputs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(500, lengths=(5, 12, 30, 7, 20), seed=3)


def test_priority_orders_requests_and_keeps_outputs(model_paths, prompts):
    """One sequence at a time, so requests finish in the order they are admitted: by (priority,
    arrival) under "priority", by arrival under "fcfs" (which ignores priority); the same tokens."""
    results = {}
    for policy in ("fcfs", "priority"):
        with LLM(model_paths["gqa_tied"], kvcache_block_size=16, max_num_seqs=1, scheduling_policy=policy) as llm:
            results[policy] = finishing_order(llm, prompts, PRIORITIES)
            generated = llm.generate(prompts, GREEDY, use_tqdm=False, priority=PRIORITIES)
            assert [out["token_ids"] for out in generated] == [results[policy][1][i] for i in range(len(prompts))]
    assert results["fcfs"][0] == [0, 1, 2, 3, 4]
    assert results["priority"][0] == [4, 1, 3, 2, 0]
    assert results["priority"][1] == results["fcfs"][1]


def test_bad_priority_arguments(model_paths, prompts):
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(model_paths["gqa_tied"], scheduling_policy="lifo")
    with LLM(model_paths["gqa_tied"], kvcache_block_size=16, scheduling_policy="priority") as llm:
        with pytest.raises(TypeError, match="priority must be an int"):
            llm.engine.add_request(prompts[0], GREEDY, priority="high")
        with pytest.raises(TypeError, match="priority must be an int"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[0, 1.5])
        with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[0])
        assert llm.engine.is_finished()                 # nothing half-queued
        expected = [o["token_ids"] for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False)]
        assert [o["token_ids"] for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=-7)] == expected
