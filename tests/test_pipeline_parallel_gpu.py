"""Pipeline stages on two GPUs: NCCL between the stages, each stage replaying its own decode CUDA
graphs (the send and receive run between replays). test_pipeline_parallel's workload (greedy
tokens and logprobs, prefix hits, preemption, n > 1, a grammar, beams, an abort, two steps in
flight) gives one GPU's tokens, with graphs and eagerly."""
import multiprocessing as mp

import pytest
import torch

from nanovllm import LLM
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from tests.test_pipeline_parallel import TIGHT, assert_same_workload, run_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("pp_gpu")), seed=4, num_hidden_layers=4)


@pytest.fixture(scope="module")
def one_gpu(four_layers) -> dict:
    with LLM(four_layers, **TIGHT) as llm:
        return run_workload(llm)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_two_stages_on_two_gpus_give_one_gpus_workload(four_layers, one_gpu, enforce_eager):
    with LLM(four_layers, **TIGHT, pipeline_parallel_size=2, enforce_eager=enforce_eager) as llm:
        driver = llm.engine.core.executor.driver
        assert len(driver.graphs) == (0 if enforce_eager else 1)
        replays = []
        if driver.graphs:
            replay = driver.graphs[0].replay
            driver.graphs[0].replay = lambda *args: replays.append(1) or replay(*args)
        got = run_workload(llm)
    assert got["max_in_flight"] == 2 and got["taken_from_oldest"] > 50     # tokens read on the device
    assert_same_workload(got, one_gpu, 2e-4)
    assert enforce_eager or len(replays) > 20      # rank 0's stage decoded through its graphs
    assert not mp.active_children()
