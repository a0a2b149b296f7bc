"""Qwen3-MoE through the whole engine on the CPU, judged token for token against a plain
transformers greedy loop over checkpoints that transformers' own Qwen3MoeForCausalLM wrote
(per-expert tensor names, as published checkpoints have them)."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.models.registry import build_model, read_model_config
from nanovllm.checkpoints.random_checkpoint import config_from_dict, tiny_config, write_demo_tokenizer, write_tiny_model
from tests.conftest import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NUM_LAYERS = 3
DENSE_LAYER = 1          # through mlp_only_layers; layers 0 and 2 are sparse
NUM_EXPERTS, TOP_K = 8, 2


def write_tiny_moe(path: str, norm_topk_prob: bool, seed: int) -> str:
    tokenizer = write_demo_tokenizer(path)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[DENSE_LAYER], max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen3MoeForCausalLM"]
    model = Qwen3MoeForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    residual_gain = 3.0 / (NUM_LAYERS / 2) ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            # sharp attention (q/k norm weights), layer outputs that dominate the residual, spread-out
            # logits and router logits: greedy is no near-tie and tokens spread over the experts
            if name.endswith("norm.weight"):
                w = torch.rand(p.shape, generator=generator) + 0.5
                w = w * 2.5 if "q_norm" in name or "k_norm" in name else w
            else:
                w = torch.randn(p.shape, generator=generator)
                if "embed_tokens" in name:
                    w = w * 0.3
                else:
                    gain = residual_gain if "o_proj" in name or "down_proj" in name else \
                        2.0 if "lm_head" in name or name.endswith("mlp.gate.weight") else 1.0
                    w = w * gain / p.shape[-1] ** 0.5
            p.copy_(w)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory) -> dict[bool, str]:
    return {norm: write_tiny_moe(str(tmp_path_factory.mktemp(f"moe_norm_{norm}")), norm, seed=10 + norm)
            for norm in (True, False)}


@pytest.fixture(params=[True, False], ids=["norm_topk", "raw_topk"])
def moe_path(request, moe_paths) -> str:
    return moe_paths[request.param]


def assert_matches_transformers(llm, outputs, prompts, hf_greedy, num_tokens=16):
    for prompt, out in zip(prompts, outputs):
        assert out["token_ids"] == hf_greedy(llm.config.model, prompt, num_tokens), f"prompt of {len(prompt)} tokens"


def test_model_config_reads_the_expert_fields():
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "qwen3-30b-a3b.json")) as f:
        config = read_model_config(config_from_dict(json.load(f)))
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.norm_topk_prob and config.decoder_sparse_step == 1 and config.mlp_only_layers == ()
    dense = read_model_config(tiny_config(500))
    assert dense.num_experts is None and dense.mlp_only_layers == ()


@pytest.mark.parametrize("sparse_step, mlp_only", [(2, [3]), (1, [0, 4]), (3, [])])
def test_sparse_layers_are_the_ones_transformers_picks(sparse_step, mlp_only):
    hf_config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                               num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                               num_experts=4, num_experts_per_tok=2, decoder_sparse_step=sparse_step,
                               mlp_only_layers=mlp_only)
    hf_config.architectures = ["Qwen3MoeForCausalLM"]
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in Qwen3MoeForCausalLM(hf_config).model.layers]
    ours = build_model(read_model_config(hf_config))
    assert [hasattr(layer.mlp, "experts") for layer in ours.model.layers] == hf_sparse
    assert 0 < sum(hf_sparse) < len(hf_sparse)


def test_random_checkpoint_stores_experts_apart(tmp_path, hf_greedy):
    """The random checkpoints bench.py writes for a config shape load in both the engine and transformers."""
    path = write_tiny_model(str(tmp_path), seed=3, architecture="Qwen3MoeForCausalLM", num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0])
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("model.layers.1.mlp.experts.3.up_proj.weight").get_shape()) == (24, 64)
    prompt = mixed_prompts(500, lengths=(20,), seed=4)[0]
    out = LLM(path, kvcache_block_size=16).generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(path, prompt, 16)


def test_checkpoint_has_per_expert_tensors_and_one_dense_layer(moe_path):
    from safetensors import safe_open
    with safe_open(os.path.join(moe_path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert f"model.layers.0.mlp.experts.{NUM_EXPERTS - 1}.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert f"model.layers.{DENSE_LAYER}.mlp.gate_proj.weight" in names
    assert not any(n.startswith(f"model.layers.{DENSE_LAYER}.mlp.experts") for n in names)


def test_mixed_batch_matches_transformers(moe_path, hf_greedy):
    llm = LLM(moe_path, kvcache_block_size=16)
    prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=(1, 3, 17, 40, 64, 7))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_transformers(llm, outputs, prompts, hf_greedy)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0
    sparse = [layer.mlp for i, layer in enumerate(llm.engine.core.executor.driver.model.model.layers) if i != DENSE_LAYER]
    assert len(sparse) == 2 and all(hasattr(mlp, "experts") for mlp in sparse)

    # the test is not weak: routing spreads over the experts and greedy choices are clear
    hf = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    margins = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + out["token_ids"][:-1]])
            result = hf(ids, output_router_logits=True)
            top2 = result.logits[0, len(prompt) - 1:].topk(2, dim=-1).values
            margins.append(float((top2[:, 0] - top2[:, 1]).min()))
            for router_logits in result.router_logits:
                chosen = router_logits.topk(TOP_K, dim=-1).indices.flatten()
                if len(chosen) >= 32:
                    counts = torch.bincount(chosen, minlength=NUM_EXPERTS)
                    assert (counts > 0).sum() >= 6 and counts.max() <= 0.5 * len(chosen), counts
    assert min(margins) > 1e-4, margins
    assert len({tuple(o["token_ids"]) for o in outputs}) == len(prompts)   # not one repeated answer


def test_prefix_cache_hits_keep_tokens(moe_path, hf_greedy):
    llm = LLM(moe_path, kvcache_block_size=16)
    vocab = llm.config.model_config.vocab_size
    shared = mixed_prompts(vocab, lengths=(70,), seed=1)[0]
    prompts = [shared + tail for tail in mixed_prompts(vocab, lengths=(1, 5, 26), seed=2)]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o["num_cached_tokens"] >= 64 for o in second)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    assert_matches_transformers(llm, second, prompts, hf_greedy)


def test_chunked_prefill_keeps_tokens(moe_paths, hf_greedy):
    llm = LLM(moe_paths[True], kvcache_block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=(100, 3, 60, 25, 1))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_transformers(llm, outputs, prompts, hf_greedy)


def test_preemption_keeps_tokens(moe_paths, hf_greedy):
    llm = LLM(moe_paths[False], kvcache_block_size=16, num_kvcache_blocks=8, max_model_len=128)
    prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=(30, 45, 20, 38, 50, 9), seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_matches_transformers(llm, outputs, prompts, hf_greedy, num_tokens=24)
    assert llm.engine.core.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.skipif((torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1) < 2,
                    reason="needs 2 devices (GPUs, or CPU cores when there is no GPU)")
def test_two_ranks_split_every_expert(moe_paths, hf_greedy):
    path = moe_paths[True]
    prompts = mixed_prompts(500, lengths=(1, 17, 70, 5))
    with LLM(path, kvcache_block_size=16, tensor_parallel_size=2, max_num_batched_tokens=32, max_num_seqs=4) as llm:
        experts = llm.engine.core.executor.driver.model.model.layers[0].mlp.experts
        assert experts.w13_weight.shape == (NUM_EXPERTS, 32, 64) and experts.w2_weight.shape == (NUM_EXPERTS, 64, 16)
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert second[2]["num_cached_tokens"] >= 64
    for out in (first, second):
        assert [o["token_ids"] for o in out] == [hf_greedy(path, p, 16) for p in prompts]


def test_checkpoint_missing_an_expert_is_named(moe_paths, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    for file in os.listdir(moe_paths[True]):
        shutil.copy(os.path.join(moe_paths[True], file), tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 weight.*'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        LLM(str(tmp_path))
