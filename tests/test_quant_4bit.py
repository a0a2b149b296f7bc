"""AWQ and GPTQ checkpoints through the engine (CPU: the GEMM's torch twin), judged token for token
against transformers running the same dequantized weights in float32; tensor parallelism; layers
left 16-bit; errors named before any weight is read; memory; the trained demo model's accuracy.

The checkpoints are written by nanovllm/checkpoints/quantized_checkpoint.py (see tests/test_quant_formats.py
for where each detail of the published layouts was checked)."""
import json
import os

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.quantized_checkpoint import (write_awq_checkpoint, write_dequantized_checkpoint,
                                                 write_gptq_checkpoint)
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from tests.conftest import mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = mixed_prompts(500, lengths=(1, 5, 23, 40, 9))

FAMILIES = {
    "qwen3": dict(seed=11),
    "qwen2_bias": dict(architecture="Qwen2ForCausalLM", seed=12),
    "llama_untied": dict(architecture="LlamaForCausalLM", seed=13, tie_word_embeddings=False, num_key_value_heads=4),
}
FORMATS = {
    "awq_g32": lambda src, dst: write_awq_checkpoint(src, dst, group_size=32),
    "awq_g64_layer1_16bit": lambda src, dst: write_awq_checkpoint(src, dst, group_size=64,
                                                                  modules_to_not_convert=["layers.1.mlp"]),
    "gptq4_g32": lambda src, dst: write_gptq_checkpoint(src, dst, bits=4, group_size=32),
    "gptq4_g32_act_order": lambda src, dst: write_gptq_checkpoint(src, dst, bits=4, group_size=32, desc_act=True),
    "gptq8_per_channel": lambda src, dst: write_gptq_checkpoint(src, dst, bits=8, group_size=-1),
    "gptq8_g64_act_order_v2": lambda src, dst: write_gptq_checkpoint(src, dst, bits=8, group_size=64, desc_act=True,
                                                                     checkpoint_format="gptq_v2"),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    return {name: write_tiny_model(str(tmp_path_factory.mktemp(name)), **args) for name, args in FAMILIES.items()}


@pytest.fixture(scope="module")
def quantized(sources, tmp_path_factory):
    """(family, format) -> (quantized checkpoint, its dequantized float32 twin), written on first use."""
    cache = {}

    def get(family: str, fmt: str) -> tuple[str, str]:
        if (family, fmt) not in cache:
            root = tmp_path_factory.mktemp(f"{family}-{fmt}")
            path = FORMATS[fmt](sources[family], str(root / "quantized"))
            cache[family, fmt] = path, write_dequantized_checkpoint(path, str(root / "dequantized"))
        return cache[family, fmt]
    return get


def generate(path: str, **engine_args) -> list[list[int]]:
    with LLM(path, kvcache_block_size=16, device="cpu", **engine_args) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_qwen3_matches_transformers_on_the_dequantized_weights(quantized, hf_greedy, fmt):
    path, reference = quantized("qwen3", fmt)
    assert generate(path) == [hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("family", ["qwen2_bias", "llama_untied"])
@pytest.mark.parametrize("fmt", ["awq_g32", "gptq4_g32_act_order"])
def test_every_family_matches_transformers(quantized, hf_greedy, family, fmt):
    path, reference = quantized(family, fmt)
    assert generate(path) == [hf_greedy(reference, p, GREEDY.max_tokens) for p in PROMPTS]


@pytest.mark.parametrize("fmt", ["awq_g32", "gptq4_g32_act_order", "gptq8_per_channel"])
def test_two_ranks_give_the_same_tokens_as_one(quantized, fmt):
    path, _ = quantized("qwen3", fmt)
    assert generate(path, tensor_parallel_size=2) == generate(path)


def test_layers_stay_packed_and_the_ignored_layer_stays_16_bit(quantized):
    path, _ = quantized("qwen3", "awq_g64_layer1_16bit")
    with LLM(path, kvcache_block_size=16, device="cpu") as llm:
        layers = llm.engine.core.executor.driver.model.model.layers
        assert layers[0].mlp.gate_up_proj.qweight.dtype == torch.int32
        assert layers[0].self_attn.qkv_proj.qweight.shape == (64 // 8, 64 + 2 * 32)   # rows packed, as the GEMM reads
        assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32
        assert layers[1].mlp.down_proj.weight.shape == (64, 128)
        assert layers[1].self_attn.o_proj.qweight.dtype == torch.int32


def test_four_bit_weights_take_about_a_quarter_of_the_bytes(tmp_path):
    from nanovllm.demo import model_path
    awq = write_awq_checkpoint(model_path(), str(tmp_path / "awq"), group_size=128)

    def linear_bytes(path):
        with LLM(path, kvcache_block_size=16, device="cpu", dtype="bfloat16", num_kvcache_blocks=64) as llm:
            model = llm.engine.core.executor.driver.model
            total = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "proj" in name)
            return total, llm.engine.core.executor.driver.weight_bytes
    (quantized_linear, quantized_all), (full_linear, full_all) = linear_bytes(awq), linear_bytes(model_path())
    # 4 bits per weight plus a 16-bit scale and zero per 128 weights: 0.25 + 4 / 128 / 2 = 0.266
    assert 0.25 < quantized_linear / full_linear < 0.27
    assert quantized_all / full_all < 0.31                   # embeddings and norms stay 16-bit


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_random_weights_of_a_16_bit_shape_load_in_four_bits(tmp_path, method):
    """load_format="dummy" (benchmarks): the shape's random weights are stored as the format stores them."""
    path = write_tiny_model(str(tmp_path), seed=1, hidden_size=128, intermediate_size=256, head_dim=32)
    os.remove(os.path.join(path, "model.safetensors"))
    with LLM(path, device="cpu", load_format="dummy", quantization=method, kvcache_block_size=16) as llm:
        layer = llm.engine.core.executor.driver.model.model.layers[0]
        assert layer.mlp.gate_up_proj.qweight.shape == (128 // 8, 2 * 256)
        assert layer.mlp.down_proj.scales.shape == (256 // 128, 128)
        assert llm.config.model_config.quantization.name == method
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0]["token_ids"]) == 4


def write_variant(path: str, **quantization_changes) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(quantization_changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    # garbage weights: an error raised after reading them would be a safetensors error instead
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    return path


@pytest.mark.parametrize("fmt,changes,engine_args,message", [
    ("gptq4_g32", dict(bits=3), {}, r"bits=3"),
    ("awq_g32", dict(bits=3), {}, r"bits=3"),
    ("awq_g32", dict(group_size=48), {}, r"group_size=48 does not divide"),
    ("gptq4_g32", dict(group_size=48), {}, r"group_size=48 does not divide"),
    # 64 rows per group divide o_proj's 64 input features, but not the 32 each of two ranks keeps
    ("gptq4_g32", dict(group_size=64), dict(tensor_parallel_size=2),
     r"group_size=64 does not divide the 32 input features of o_proj on each of 2 ranks"),
    ("awq_g32", {}, dict(quantization="gptq"), r"disagrees"),
    ("gptq4_g32", {}, dict(quantization="fp8"), r"disagrees"),
    ("awq_g32", dict(version="gemv"), {}, r"version"),
    ("gptq4_g32", dict(checkpoint_format="marlin"), {}, r"checkpoint_format"),
])
def test_bad_checkpoints_are_named_before_any_weight_is_read(sources, tmp_path, fmt, changes, engine_args, message):
    path = FORMATS[fmt](sources["qwen3"], str(tmp_path / "q"))
    write_variant(path, **changes)
    with pytest.raises(ValueError, match="quantization") as error:
        LLM(path, device="cpu", kvcache_block_size=16, **engine_args)
    assert error.match(message)


# ---- the trained demo model -----------------------------------------------------------------------
# scripts/quantized_demo_accuracy.py measures the full sets; the test takes a sample to stay fast.

@pytest.fixture(scope="module")
def accuracy():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "quantized_demo_accuracy", Path(__file__).resolve().parent.parent / "scripts" / "quantized_demo_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return lambda path: module.demo_accuracy(path, num_additions=60, phrasings=1)


@pytest.fixture(scope="module")
def full_accuracy(accuracy):
    from nanovllm.demo import model_path
    return accuracy(model_path())


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_demo_model_keeps_its_accuracy_in_four_bits(tmp_path, accuracy, full_accuracy, fmt):
    from nanovllm.demo import model_path
    write = write_awq_checkpoint if fmt == "awq" else write_gptq_checkpoint
    quantized = accuracy(write(model_path(), str(tmp_path / fmt), group_size=128))
    print(f"demo model, 16-bit sums {full_accuracy[0]:.1%} capitals {full_accuracy[1]:.1%}; {fmt} 4-bit "
          f"sums {quantized[0]:.1%} capitals {quantized[1]:.1%}")
    assert quantized[0] >= full_accuracy[0] - 0.05 and quantized[1] >= full_accuracy[1] - 0.05
