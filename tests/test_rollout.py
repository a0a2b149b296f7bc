"""Rollout control (docs/rollout.md): weights updated in place equal a fresh engine on those
weights (TP=2, online FP8, partial, from disk, from a trainer process), bad updates change nothing,
sleep / wake keep outputs, weight_version counts, no KV block is left held."""
import glob
import multiprocessing as mp
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from nanovllm.kernels import int_dequantize
from nanovllm.kernels import zeroed_workspace as zeroed_workspace_module
from nanovllm.kernels.int_dequantize import dequantize
from nanovllm.kernels.zeroed_workspace import zeroed_workspace
from tests.conftest import free_port, mixed_prompts

torch.set_num_threads(2)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
PROMPTS = mixed_prompts(500, lengths=(3, 20, 40))
# a bounded pool: on a GPU two engines (the updated one and a fresh reference) are alive at once
ENGINE = dict(kvcache_block_size=16, max_num_seqs=4, max_model_len=512, num_kvcache_blocks=128)


def tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(file))
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """A and B: the same shape, different weights; AB: A with layer 1 taken from B."""
    root = tmp_path_factory.mktemp("rollout")
    a = write_tiny_model(str(root / "a"), seed=11)
    b = write_tiny_model(str(root / "b"), seed=12)
    ab = str(root / "ab")
    shutil.copytree(a, ab, ignore=shutil.ignore_patterns("*.safetensors"))
    mixed = {n: (t_b if ".layers.1." in n else t_a) for (n, t_a), t_b in zip(tensors(a).items(), tensors(b).values())}
    save_file(mixed, os.path.join(ab, "model.safetensors"))
    return {"a": a, "b": b, "ab": ab}


def run(llm: LLM) -> list[tuple[list[int], list[dict]]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o["token_ids"], o["logprobs"]) for o in outs]


def assert_same(got, want):
    for (ids, logprobs), (ids_ref, logprobs_ref) in zip(got, want, strict=True):
        assert ids == ids_ref
        for step, step_ref in zip(logprobs, logprobs_ref, strict=True):
            assert step.keys() == step_ref.keys()
            assert all(abs(step[t] - step_ref[t]) < 1e-4 for t in step)


def assert_no_block_held(llm: LLM):
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def reference(paths) -> dict:
    """Outputs of fresh engines: key (checkpoint, engine args) -> outputs."""
    cache = {}

    def get(name: str, **engine_args):
        key = (name, tuple(sorted(engine_args.items())))
        if key not in cache:
            with LLM(paths[name], **ENGINE, **engine_args) as llm:
                cache[key] = run(llm)
        return cache[key]
    return get


def test_update_weights_equals_a_fresh_engine_and_bad_updates_change_nothing(paths, reference):
    with LLM(paths["a"], **ENGINE) as llm:
        before = run(llm)
        assert_same(before, reference("a"))
        assert before != reference("b")                 # the two models really differ
        assert llm.generate(PROMPTS[1:2], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] > 0   # cached prefix
        weights_b = tensors(paths["b"])
        with pytest.raises(ValueError, match="model.layers.0.mlp.nope.weight"):
            llm.update_weights(list(weights_b.items()) + [("model.layers.0.mlp.nope.weight", torch.zeros(2))])
        bad = dict(weights_b)
        bad["model.layers.1.self_attn.k_proj.weight"] = bad["model.layers.1.self_attn.k_proj.weight"][:-1]
        with pytest.raises(ValueError, match=r"k_proj.weight.*shape"):
            llm.update_weights(bad.items())
        with pytest.raises(TypeError, match="weight_version"):
            llm.update_weights(weights_b.items(), weight_version="7")
        assert llm.weight_version == 0
        assert_same(run(llm), before)                   # nothing changed

        assert llm.update_weights(weights_b.items()) == 1     # a dict's items, an iterable of pairs
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert all(o["weight_version"] == 1 and o["num_cached_tokens"] == 0 for o in outs)   # cache was reset
        assert_same([(o["token_ids"], o["logprobs"]) for o in outs], reference("b"))
        assert llm.update_weights_from_disk(paths["a"], weight_version=10) == 10
        assert_same(run(llm), reference("a"))
        assert llm.engine.weight_version == 10
        assert llm.reset_prefix_cache() is True
        assert_no_block_held(llm)


def test_partial_update_equals_the_checkpoint_with_those_layers_replaced(paths, reference):
    with LLM(paths["a"], **ENGINE) as llm:
        llm.update_weights((n, t) for n, t in tensors(paths["b"]).items() if ".layers.1." in n)
        assert_same(run(llm), reference("ab"))
        assert_no_block_held(llm)


def test_online_fp8_update_requantizes_in_place(paths, reference):
    with LLM(paths["a"], quantization="fp8", **ENGINE) as llm:
        qkv = llm.engine.core.executor.driver.model.model.layers[0].self_attn.qkv_proj
        storage = qkv.weight.data_ptr(), qkv.weight_scale.data_ptr()
        assert qkv.weight.dtype == torch.float8_e4m3fn
        llm.update_weights(tensors(paths["b"]).items())
        assert (qkv.weight.data_ptr(), qkv.weight_scale.data_ptr()) == storage
        assert_same(run(llm), reference("b", quantization="fp8"))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")
def test_two_ranks_each_load_their_shard(paths, reference):
    with LLM(paths["a"], tensor_parallel_size=2, **ENGINE) as llm:
        llm.update_weights(tensors(paths["b"]).items())
        assert_same(run(llm), reference("b"))
        llm.update_weights_from_disk(paths["ab"])
        assert_same(run(llm), reference("ab"))
        assert llm.weight_version == 2
        assert_no_block_held(llm)


def trainer(path: str, port: int, world_size: int) -> None:
    """A trainer process: rank 0 of the weight group, broadcasting every tensor of the checkpoint."""
    from nanovllm.worker.weight_sync import weight_sync_group
    group = weight_sync_group("127.0.0.1", port, 0, world_size, "gloo")
    for tensor in tensors(path).values():
        group.broadcast(tensor.contiguous())


def test_update_from_a_trainer_process_equals_the_in_process_update(paths, reference):
    weights_b = tensors(paths["b"])
    with LLM(paths["a"], **ENGINE) as llm:
        with pytest.raises(RuntimeError, match="init_weight_update_group"):
            llm.update_weights_from_distributed(["x"], ["float32"], [[1]])
        with pytest.raises(ValueError, match="backend"):
            llm.init_weight_update_group("127.0.0.1", 1, 1, 2, backend="mpi")
        port = free_port()
        process = mp.get_context("spawn").Process(target=trainer, args=(paths["b"], port, 2))
        process.start()
        try:
            llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo")
            names = list(weights_b)
            version = llm.update_weights_from_distributed(names, [t.dtype for t in weights_b.values()],
                                                          [t.shape for t in weights_b.values()])
        finally:
            process.join(timeout=60)
        assert process.exitcode == 0 and version == 1
        assert_same(run(llm), reference("b"))


def test_sleep_and_wake_up(paths, reference):
    with LLM(paths["a"], **ENGINE) as llm:
        driver = llm.engine.core.executor.driver
        before = run(llm)
        # the kernels' scratch memory (on a GPU: split-K sums, prefills' dequantized weights) goes too
        zeroed_workspace(torch.device("cpu"), torch.float32, 8)
        dequantize(torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, 8), torch.zeros(1, 8), 4, 8)
        llm.sleep(level=1)
        assert llm.is_sleeping() and driver.kv_cache.tensor is None
        assert all(p.numel() == 0 for p in driver.model.parameters())
        assert not zeroed_workspace_module._buffers and not int_dequantize._scratch
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.engine.add_request(PROMPTS[0])
        llm.wake_up(tags=["kv_cache"])
        assert llm.is_sleeping()
        llm.wake_up()
        assert not llm.is_sleeping()
        assert_same(run(llm), before)

        llm.sleep(level=2)
        with pytest.raises(RuntimeError, match="wake_up"):
            llm.update_weights(tensors(paths["b"]).items())
        llm.wake_up(tags=["weights"])
        llm.update_weights(tensors(paths["b"]).items())
        llm.wake_up(tags=["kv_cache"])
        assert_same(run(llm), reference("b"))
        with pytest.raises(ValueError, match="level"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match="tags"):
            llm.wake_up(tags=["kv"])
        llm.engine.add_request(PROMPTS[0], GREEDY)
        with pytest.raises(RuntimeError, match="idle"):
            llm.sleep()
        while not llm.engine.is_finished():
            llm.engine.step()
        assert_no_block_held(llm)
