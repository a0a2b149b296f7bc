"""kv_cache_dtype="fp8": float8 e4m3 storage with per-layer scales measured at start-up, against the
model's own dtype on the same tiny model. The tiny test models attend sharply on purpose (small
changes flip their greedy choices), so the bar is a measured agreement rate and a logprob bound;
the demo model's accuracy check is in test_demo.py."""
import glob
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.fp8_primitives import FP8_DTYPE, FP8_MAX
from tests.conftest import mixed_prompts

PROMPTS = mixed_prompts(500, lengths=(5, 30, 60, 17, 90, 3, 44, 71, 120, 8, 33, 66, 12, 50, 99, 140), seed=0)


@pytest.fixture(scope="module")
def engines(model_paths):
    path = model_paths["gqa_tied"]
    return (LLM(path, kvcache_block_size=16, num_kvcache_blocks=64),
            LLM(path, kvcache_block_size=16, num_kvcache_blocks=64, kv_cache_dtype="fp8"))


def test_pool_is_float8_with_measured_scales(engines):
    auto, fp8 = engines
    cache = fp8.engine.core.executor.driver.kv_cache
    assert cache.tensor.dtype == FP8_DTYPE and cache.block_bytes * 4 == auto.engine.core.executor.driver.kv_cache.block_bytes
    layer = fp8.engine.core.executor.driver.attention_layers[1]
    assert layer.k_scale is not None and layer.k_scale.data_ptr() == cache.scales[0, 1].data_ptr()
    fp8.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    stored = cache.tensor.float().abs()
    # scales leave headroom: what real prompts store stays well inside e4m3's range
    assert 0 < stored.max() < FP8_MAX
    assert torch.all(cache.scales > 0)


def test_fp8_tracks_the_model_dtype(engines):
    """Measured on CPU: first tokens agree for 14 of 16 prompts, logprobs of the top tokens differ by
    0.25 on average (at most 1.1), on this deliberately sharp model."""
    auto, fp8 = engines
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    ours, theirs = fp8.generate(PROMPTS, params, use_tqdm=False), auto.generate(PROMPTS, params, use_tqdm=False)
    agree = sum(a["token_ids"] == b["token_ids"] for a, b in zip(ours, theirs))
    errors = [abs(a["logprobs"][0][t] - b["logprobs"][0][t]) for a, b in zip(ours, theirs)
              for t in set(a["logprobs"][0]) & set(b["logprobs"][0])]
    assert agree >= 12, agree
    assert sum(errors) / len(errors) < 0.5 and max(errors) < 2.0


def test_fp8_runs_long_decodes_with_prefix_hits_and_stays_consistent(engines):
    _, fp8 = engines
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = fp8.generate(PROMPTS[:6], params, use_tqdm=False)
    second = fp8.generate(PROMPTS[:6], params, use_tqdm=False)
    assert any(o["num_cached_tokens"] for o in second)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    assert fp8.engine.core.scheduler.block_manager.num_used_blocks == 0


def test_kv_cache_dtype_is_checked(model_paths):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model_paths["gqa_tied"], kv_cache_dtype="int4")


def with_kv_scales(source: str, dest, k_scales, v_scales) -> str:
    """A copy of the checkpoint at source with each layer's self_attn.k_scale and v_scale added, as
    checkpoints quantised for an FP8 KV cache carry them."""
    shutil.copytree(source, dest)
    files = sorted(glob.glob(os.path.join(dest, "*.safetensors")))
    tensors = load_file(files[-1])
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(tensors, files[-1], metadata={"format": "pt"})
    index = os.path.join(dest, "model.safetensors.index.json")
    if os.path.isfile(index):                              # a sharded checkpoint lists its tensors
        with open(index) as f:
            content = json.load(f)
        content["weight_map"].update({name: os.path.basename(files[-1]) for name in tensors})
        with open(index, "w") as f:
            json.dump(content, f)
    return str(dest)


def test_checkpoint_kv_scales_replace_the_measured_ones(engines, model_paths, tmp_path):
    """Scales in the checkpoint are used as they are (a scale per head becomes the layer's largest);
    the 16-bit cache ignores them, and a checkpoint without them gets measured scales."""
    auto, fp8 = engines
    measured = fp8.engine.core.executor.driver.kv_cache.scales.flatten(1)          # [K or V, layer]
    k_scales = [1.5 * float(s) for s in measured[0]]
    v_scales = [[0.5 * float(s), 1.25 * float(s)] for s in measured[1]]   # per KV head
    path = with_kv_scales(model_paths["gqa_tied"], tmp_path / "scaled", k_scales, v_scales)
    scaled = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64, kv_cache_dtype="fp8")
    got = scaled.engine.core.executor.driver.kv_cache.scales.flatten(1)
    assert got[0].tolist() == pytest.approx(k_scales, rel=1e-6)
    assert got[1].tolist() == pytest.approx([max(v) for v in v_scales], rel=1e-6)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = scaled.generate(PROMPTS[:4], params, use_tqdm=False)
    assert all(len(o["token_ids"]) == 6 for o in outputs)
    ignored = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    assert [o["token_ids"] for o in ignored.generate(PROMPTS[:4], params, use_tqdm=False)] == \
        [o["token_ids"] for o in auto.generate(PROMPTS[:4], params, use_tqdm=False)]


def test_a_checkpoint_kv_scale_must_be_positive(model_paths, tmp_path):
    path = with_kv_scales(model_paths["gqa_tied"], tmp_path / "bad", [0.1, 0.0], [0.1, 0.1])
    with pytest.raises(ValueError, match="k_scale of layer 1"):
        LLM(path, kvcache_block_size=16, num_kvcache_blocks=64, kv_cache_dtype="fp8")


def _accuracy_script():
    spec = importlib.util.spec_from_file_location(
        "kv_cache_accuracy", Path(__file__).resolve().parent.parent / "scripts" / "kv_cache_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accuracy_script_captures_prefill_and_first_decode_from_the_forced_token(model_paths):
    """scripts/kv_cache_accuracy.py: its logits rows are each prompt's prefill and first decode step
    (against transformers), its forced first token is the one decoded from, an engine against
    itself has no error, and a float8 cache a small one."""
    script = _accuracy_script()
    path = model_paths["gqa_tied"]
    prompts = mixed_prompts(500, lengths=(40, 7, 90, 23), seed=5)
    reference = script.capture_step_logits(path, prompts, "float32", "auto", "cpu")
    forced = [(t + 1) % 500 for t in reference.first_tokens]      # not what greedy would pick
    again = script.capture_step_logits(path, prompts, "float32", "auto", "cpu", forced)
    fp8 = script.capture_step_logits(path, prompts, "float32", "fp8", "cpu", forced)
    assert again.first_tokens == fp8.first_tokens == forced
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            logits = hf(torch.tensor([prompt + [forced[i]]])).logits[0]
            torch.testing.assert_close(again.prefill[i], logits[-2], atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(again.decode[i], logits[-1], atol=2e-4, rtol=2e-4)
            assert reference.first_tokens[i] == int(logits[-2].argmax())
    same = script.logits_errors(again.prefill, reference.prefill)
    assert same == dict(rel_l2_mean=0.0, rel_l2_max=0.0, max_abs=0.0, kl_mean=0.0, top1_agree=1.0)
    errors = script.logits_errors(again.decode, fp8.decode)
    assert 1e-3 < errors["rel_l2_mean"] <= errors["rel_l2_max"] < 0.5 and errors["kl_mean"] > 0
