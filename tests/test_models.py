"""Every supported family, built by transformers' own config and model classes with random weights,
judged token for token against a plain transformers greedy loop; and the errors for checkpoints
the engine cannot run."""
import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary import rotary_inv_freq
from nanovllm.models.registry import read_model_config
from nanovllm.checkpoints.random_checkpoint import config_from_dict, write_tiny_model
from tests.conftest import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
# Llama 3.1's rule with a short original context, so that prompts of a few hundred tokens feel it
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

# GQA ratio (attention heads / KV heads) 2, 4, 1 and 2; tied and untied heads; every kind of bias
FAMILY_SHAPES = {
    "qwen2_bias_tied_sharded": dict(architecture="Qwen2ForCausalLM", seed=4, max_shard_bytes=60_000),
    "llama3_scaled_tied_gqa4": dict(architecture="LlamaForCausalLM", seed=5, hidden_size=128,
                                    num_attention_heads=8, num_key_value_heads=2, rope_scaling=LLAMA3_SCALING),
    "llama_untied_mha_biases": dict(architecture="LlamaForCausalLM", seed=7, tie_word_embeddings=False,
                                    num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    "mistral_untied": dict(architecture="MistralForCausalLM", seed=6, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory) -> dict[str, str]:
    return {name: write_tiny_model(str(tmp_path_factory.mktemp(name)), **args) for name, args in FAMILY_SHAPES.items()}


@pytest.fixture(params=list(FAMILY_SHAPES))
def family_path(request, family_paths) -> str:
    return family_paths[request.param]


def assert_matches_transformers(path, outputs, prompts, hf_greedy, num_tokens=16):
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(path, prompt, num_tokens), f"prompt of {len(prompt)} tokens"


def variant(source: str, dest, drop_tensor: str | None = None, **config_changes) -> str:
    """A copy of a checkpoint with config.json entries changed (None deletes one) or one tensor dropped."""
    dest = str(dest)
    shutil.copytree(source, dest)
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f)
    if drop_tensor:
        for file in glob.glob(os.path.join(dest, "*.safetensors")):
            tensors = load_file(file)
            if tensors.pop(drop_tensor, None) is not None:
                save_file(tensors, file, metadata={"format": "pt"})
    return dest


# ---- equality with transformers ------------------------------------------------------------------

def test_mixed_batch_matches_transformers_with_varied_tokens(family_path, hf_greedy):
    llm = LLM(family_path, kvcache_block_size=16)
    prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=(1, 3, 17, 100, 7, 33))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_transformers(family_path, outputs, prompts, hf_greedy)
    # a random model that repeats one token would make the comparison weak
    assert sum(len(set(o["token_ids"])) for o in outputs) / len(outputs) >= 6


def test_prefix_cache_hits_keep_tokens(family_path, hf_greedy):
    llm = LLM(family_path, kvcache_block_size=16)
    shared = mixed_prompts(500, lengths=(70,), seed=1)[0]
    prompts = [shared + tail for tail in mixed_prompts(500, lengths=(1, 26), seed=2)]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o["num_cached_tokens"] >= 64 for o in second)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    assert_matches_transformers(family_path, second, prompts, hf_greedy)


def test_chunked_prefill_keeps_tokens(family_path, hf_greedy):
    llm = LLM(family_path, kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = mixed_prompts(500, lengths=(70, 3, 25))
    assert_matches_transformers(family_path, llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf_greedy)


def test_preemption_keeps_tokens(family_path, hf_greedy):
    # 8 blocks of 16 tokens hold one sequence of max_model_len=128, not all of these at once
    llm = LLM(family_path, kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128)
    prompts = mixed_prompts(500, lengths=(30, 45, 38, 50), seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_matches_transformers(family_path, outputs, prompts, hf_greedy, num_tokens=24)


@pytest.mark.skipif((torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1) < 2,
                    reason="needs 2 devices (GPUs, or CPU cores when there is no GPU)")
def test_two_ranks_match_transformers(family_path, hf_greedy):
    """Biases split with their weights, a KV head per rank (GQA 4 and 2) or two (MHA)."""
    prompts = mixed_prompts(500, lengths=(1, 17, 70))
    with LLM(family_path, kvcache_block_size=16, tensor_parallel_size=2, max_num_batched_tokens=32,
             max_num_seqs=4) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_transformers(family_path, outputs, prompts, hf_greedy)


def test_llama3_rope_scaling_changes_the_tokens(family_paths, hf_greedy, tmp_path):
    """Past the original context the scaled model continues differently from the same weights
    without scaling, and the engine follows the scaled one."""
    scaled = family_paths["llama3_scaled_tied_gqa4"]
    unscaled = variant(scaled, tmp_path / "unscaled", rope_scaling=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    prompts = mixed_prompts(500, lengths=(150, 300), seed=9)
    assert any(hf_greedy(scaled, p, 16) != hf_greedy(unscaled, p, 16) for p in prompts)
    llm = LLM(scaled, kvcache_block_size=16)
    assert llm.config.model_config.rope_scaling["rope_type"] == "llama3"
    assert_matches_transformers(scaled, llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf_greedy)


def test_llama3_inv_freq_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for shape in ("llama-3.1-8b.json", "llama-3.2-1b.json"):
        with open(os.path.join(CONFIGS, shape)) as f:
            hf_config = config_from_dict(json.load(f))
        model_config = read_model_config(hf_config)
        expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
        ours = rotary_inv_freq(model_config.head_dim, model_config.rope_theta, model_config.rope_scaling)
        torch.testing.assert_close(ours, expected)
        plain = rotary_inv_freq(model_config.head_dim, model_config.rope_theta)
        factor = model_config.rope_scaling["factor"]
        assert ours[0] == plain[0] and torch.isclose(ours[-1], plain[-1] / factor)   # fast kept, slow stretched


# ---- configs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", sorted(os.listdir(CONFIGS)))
def test_config_shapes_read_the_same_in_both_styles(shape, tmp_path):
    """The published config.json (rope_theta, torch_dtype) and transformers 5's rewrite of it
    (rope_parameters, dtype) give the same model config."""
    with open(os.path.join(CONFIGS, shape)) as f:
        published = json.load(f)
    hf_config = config_from_dict(published)
    hf_config.save_pretrained(tmp_path)
    rewritten = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in rewritten and "rope_theta" not in rewritten
    from transformers import AutoConfig
    old, new = read_model_config(hf_config), read_model_config(AutoConfig.from_pretrained(tmp_path))
    assert old == new
    assert old.architecture == published["architectures"][0]
    assert (old.num_heads, old.num_kv_heads, old.num_layers) == (
        published["num_attention_heads"], published["num_key_value_heads"], published["num_hidden_layers"])
    assert old.head_dim == published.get("head_dim", published["hidden_size"] // published["num_attention_heads"])
    assert old.rope_theta == published["rope_theta"] and old.dtype == torch.bfloat16
    assert old.tie_word_embeddings == published["tie_word_embeddings"]
    assert old.sliding_window is None                  # published windows are switched off or absent
    assert old.qkv_bias == (published["architectures"][0] == "Qwen2ForCausalLM")
    assert old.rope_scaling == (None if not published.get("rope_scaling") else published["rope_scaling"])


# ---- what the engine refuses ---------------------------------------------------------------------

def test_unsupported_architecture_is_named(family_paths, tmp_path):
    path = variant(family_paths["mistral_untied"], tmp_path / "m", architectures=["MixtralForCausalLM"])
    with pytest.raises(ValueError, match=r"'MixtralForCausalLM' is not supported; supported: .*LlamaForCausalLM"):
        LLM(path)
    path = variant(family_paths["mistral_untied"], tmp_path / "none", architectures=None)
    with pytest.raises(ValueError, match="architectures"):
        LLM(path)


def test_unsupported_rope_scaling_is_named(family_paths, tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    path = variant(family_paths["llama3_scaled_tied_gqa4"], tmp_path / "yarn", rope_scaling=None, rope_parameters=yarn)
    supported = r"supported: \['default', 'llama3'\]"
    with pytest.raises(ValueError, match=r"'yarn' is not supported for LlamaForCausalLM; " + supported):
        LLM(path)
    llama3 = dict(LLAMA3_SCALING, rope_theta=10000.0)
    path = variant(family_paths["qwen2_bias_tied_sharded"], tmp_path / "q", rope_scaling=None, rope_parameters=llama3)
    with pytest.raises(ValueError, match=r"'llama3' is not supported for Qwen2ForCausalLM; supported: \['default'\]"):
        LLM(path)


def test_unsupported_activation_is_named(family_paths, tmp_path):
    path = variant(family_paths["mistral_untied"], tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        LLM(path)


def test_sliding_window_shorter_than_max_model_len_is_refused(family_paths, hf_greedy, tmp_path):
    path = variant(family_paths["mistral_untied"], tmp_path / "window", sliding_window=64)
    with pytest.raises(ValueError, match=r"max_model_len=1024 .* sliding_window=64"):
        LLM(path)
    # within the window, sliding or not is the same attention
    llm = LLM(path, max_model_len=64, kvcache_block_size=16)
    prompts = mixed_prompts(500, lengths=(40, 7))
    assert_matches_transformers(path, llm.generate(prompts, GREEDY, use_tqdm=False), prompts, hf_greedy)


@pytest.mark.parametrize("shape, tensor", [
    ("qwen2_bias_tied_sharded", "model.layers.1.self_attn.k_proj.bias"),
    ("mistral_untied", "lm_head.weight"),
])
def test_missing_weight_is_named(family_paths, tmp_path, shape, tensor):
    path = variant(family_paths[shape], tmp_path / "m", drop_tensor=tensor)
    with pytest.raises(ValueError, match=f"lacks 1 weight.*{tensor}"):
        LLM(path)
