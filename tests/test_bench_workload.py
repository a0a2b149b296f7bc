"""bench_requests must draw nano-vllm's benchmark requests, which the numbers in docs/benchmarks.md
were measured on."""
import random

from nanovllm.checkpoints.bench_workload import bench_requests


def test_bench_requests_are_those_of_nano_vllm_benchmark():
    state = random.getstate()
    try:   # nano-vllm's bench.py draws from the global generator, every prompt first
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    assert bench_requests() == list(zip(prompts, max_tokens))


def test_bench_request_ranges_are_inclusive():
    requests = bench_requests(40, input_len=(3, 4), output_len=(7, 8), max_token_id=2)
    assert len(requests) == 40
    assert {len(prompt) for prompt, _ in requests} == {3, 4}
    assert {n for _, n in requests} == {7, 8}
    assert {token for prompt, _ in requests for token in prompt} == {0, 1, 2}
