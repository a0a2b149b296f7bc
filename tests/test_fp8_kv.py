"""kv_cache_dtype="fp8": float8 e4m3 storage with per-layer scales measured at start-up, against the
model's own dtype on the same tiny model. The tiny test models attend sharply on purpose (small
changes flip their greedy choices), so the bar is a measured agreement rate and a logprob bound;
the demo model's accuracy check is in test_demo.py."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tests.conftest import mixed_prompts

PROMPTS = mixed_prompts(500, lengths=(5, 30, 60, 17, 90, 3, 44, 71, 120, 8, 33, 66, 12, 50, 99, 140), seed=0)


@pytest.fixture(scope="module")
def engines(model_paths):
    path = model_paths["gqa_tied"]
    return (LLM(path, kvcache_block_size=16, num_kvcache_blocks=64),
            LLM(path, kvcache_block_size=16, num_kvcache_blocks=64, kv_cache_dtype="fp8"))


def test_pool_is_float8_with_measured_scales(engines):
    auto, fp8 = engines
    cache = fp8.model_runner.kv_cache
    assert cache.tensor.dtype == FP8_DTYPE and cache.block_bytes * 4 == auto.model_runner.kv_cache.block_bytes
    layer = fp8.model_runner.attention_layers[1]
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
    assert fp8.block_manager.num_used_blocks == 0


def test_kv_cache_dtype_is_checked(model_paths):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model_paths["gqa_tied"], kv_cache_dtype="int4")
