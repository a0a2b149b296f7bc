"""The RMSNorm and SiLU-and-mul before an FP8 projection quantize its input in their own pass
(nanovllm/models/blocks.py, fuse_input_quantization): the engine gives the same greedy tokens and
the same logits, bit for bit, as with every layer quantizing its own input, in each FP8 layout (on
CUDA within an ulp's effect: see tests/test_kernels_fp8_fused.py).

The fusion is turned off by building the model with fuse_input_quantization doing nothing (before
any CUDA graph is captured), which is the unfused composition: the norm's 16-bit output, then the
FP8 layer's own quantization.
"""
import gc

import pytest
import torch

import nanovllm.models.blocks as blocks
import nanovllm.quantization.fp8 as fp8_methods
from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import Sequence
from nanovllm.kernels.fp8_linear import QuantizedActivation
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.quantization.fp8 import GEMV_MAX_ROWS
from nanovllm.checkpoints.fp8_checkpoint import write_fp8_checkpoint
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from tests.conftest import mixed_prompts
from tests.test_quantization_fp8 import write_tiny_moe

PROMPTS = mixed_prompts(500, lengths=(1, 5, 17, 40, 9), seed=12)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# dimensions above one 128-block, so block layouts have several groups per row
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
BF16 = dict(dtype="bfloat16")    # the CPU's default is float32; 16 bits round the output before quantizing
# case -> (architecture, layout or "online", engine arguments, the group sizes the producers take:
# input_layernorm, post_attention_layernorm, mlp.act_fn of layer 0)
CASES = {
    "online": ("Qwen3ForCausalLM", "online", dict(quantization="fp8"), (256, 256, 512)),
    "block": ("Qwen3ForCausalLM", "fp8-block", BF16, (128, 128, 128)),
    "channel-bias": ("Qwen2ForCausalLM", "ct-channel-dynamic", BF16, (256, 256, 512)),
    "tensor-dynamic": ("MistralForCausalLM", "ct-tensor-dynamic", BF16, (256, 256, 512)),
    "tensor-static": ("LlamaForCausalLM", "fp8-tensor-static", BF16, (None, None, None)),   # the scale is given
}
PRODUCERS = ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.layers.0.mlp.act_fn")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for case, (architecture, layout, _, _) in CASES.items():
        root = tmp_path_factory.mktemp(case)
        src = write_tiny_model(str(root / "src"), architecture=architecture, seed=40 + len(paths), **SHAPE)
        if layout == "online":
            paths[case] = src
        else:
            write_fp8_checkpoint(src, str(root / "fp8"), str(root / "ref"), layout, calibration_prompts=PROMPTS)
            paths[case] = str(root / "fp8")
    return paths


@pytest.fixture
def linear_inputs(monkeypatch) -> list:
    """What every FP8 layer is given: a QuantizedActivation or a 16-bit tensor (eager calls only)."""
    seen = []
    multiply = fp8_methods.Fp8LinearMethod.multiply

    def recording(self, x, *args, **kwargs):
        seen.append(x)
        return multiply(self, x, *args, **kwargs)

    monkeypatch.setattr(fp8_methods.Fp8LinearMethod, "multiply", recording)
    return seen


def step_logits(llm: LLM) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a prefill step over PROMPTS and of the decode step after it."""
    for prompt in PROMPTS:
        llm.engine.core.scheduler.add(Sequence(prompt, SamplingParams(temperature=0, max_tokens=4)))
    runner = llm.engine.core.executor
    prefill = llm.engine.core.scheduler.schedule()
    assert prefill.is_prefill and len(prefill.seqs) == len(PROMPTS)
    first = runner.driver.execute(runner.prepare_step(prefill))
    llm.engine.core.scheduler.fill(llm.engine.core.scheduler.advance(prefill), first.argmax(-1).tolist())
    decode = llm.engine.core.scheduler.schedule()
    assert not decode.is_prefill
    return first.cpu(), runner.driver.execute(runner.prepare_step(decode)).cpu()


def run(path: str, fused: bool, **engine_args) -> tuple[dict, list[list[int]], tuple[torch.Tensor, torch.Tensor]]:
    """Producers' group sizes as built, greedy tokens, step logits; the model built unfused if not `fused`."""
    with pytest.MonkeyPatch.context() as patch:
        if not fused:
            patch.setattr(blocks, "fuse_input_quantization", lambda producer, consumer: None)
        llm = LLM(path, kvcache_block_size=16, **engine_args)
    with llm:
        modules = dict(llm.engine.core.executor.driver.model.named_modules())
        groups = {name: modules[name].quant_group_size for name in PRODUCERS + ("model.norm",) if name in modules}
        tokens = [out["token_ids"] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        logits = step_logits(llm)
    del llm, modules
    gc.collect()            # the next engine sizes its KV pool from the free device memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return groups, tokens, logits


@pytest.mark.parametrize("case", list(CASES))
def test_fused_quantization_changes_no_bit(checkpoints, linear_inputs, case):
    _, _, engine_args, expected_groups = CASES[case]
    groups, tokens, (prefill, decode) = run(checkpoints[case], fused=True, **engine_args)
    assert groups == dict(zip(PRODUCERS, expected_groups), **{"model.norm": None})   # the LM head's input stays 16-bit
    carried = sum(isinstance(x, QuantizedActivation) for x in linear_inputs)
    if expected_groups[0] is not None:
        assert carried > 0
        # every carrier is in its layer's group size: the row's input features, or 128-column groups
        assert all(x.scale.shape[1] == (x.q.shape[1] // 128 if case == "block" else 1)
                   for x in linear_inputs if isinstance(x, QuantizedActivation))
    else:
        assert carried == 0
    linear_inputs.clear()
    unfused_groups, unfused_tokens, (unfused_prefill, unfused_decode) = run(checkpoints[case], fused=False,
                                                                            **engine_args)
    assert set(unfused_groups.values()) == {None}
    assert not any(isinstance(x, QuantizedActivation) for x in linear_inputs) and linear_inputs
    assert tokens == unfused_tokens
    if torch.cuda.is_available():   # a fused norm may sum its squares in another order: an ulp here and there
        for fused_logits, unfused_logits in ((prefill, unfused_prefill), (decode, unfused_decode)):
            torch.testing.assert_close(fused_logits, unfused_logits, rtol=0,
                                       atol=1e-2 * unfused_logits.abs().max().item())
    else:
        assert torch.equal(prefill, unfused_prefill) and torch.equal(decode, unfused_decode)


def test_moe_experts_take_their_input_16_bit(tmp_path, linear_inputs):
    """Qwen3-MoE with FP8 block experts: the attention's projections take float8 from the norm, the
    experts (not a plain linear layer) their 16-bit input; the tokens and logits are unchanged."""
    src = write_tiny_moe(str(tmp_path / "src"))
    write_fp8_checkpoint(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), "fp8-block")
    path = str(tmp_path / "fp8")
    fused = run(path, fused=True, **BF16)
    groups = fused[0]
    assert groups["model.layers.0.input_layernorm"] == 128
    assert groups["model.layers.0.post_attention_layernorm"] is None
    assert any(isinstance(x, QuantizedActivation) for x in linear_inputs)
    unfused = run(path, fused=False, **BF16)
    assert fused[1] == unfused[1]
    assert torch.equal(fused[2][0], unfused[2][0]) and torch.equal(fused[2][1], unfused[2][1])


def test_producers_quantize_where_the_linear_layer_would():
    """On the CPU always; on CUDA only above GEMV_MAX_ROWS rows (fewer go to the GEMV in 16 bits)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    norm, act = RMSNorm(256).to(device, dtype), SiluAndMul()
    norm.quant_group_size = act.quant_group_size = 128
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 256, device=device, dtype=dtype)
        quantized = device == "cpu" or rows > GEMV_MAX_ROWS
        for out in (norm(x), norm(x, x.clone())[0], act(x)):
            assert isinstance(out, QuantizedActivation) == quantized
    norm.quant_group_size = act.quant_group_size = None
    assert isinstance(norm(torch.randn(8, 256, device=device, dtype=dtype)), torch.Tensor)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_row_steps_stay_16_bit_for_the_gemv_on_cuda(checkpoints, linear_inputs, monkeypatch):
    """One sequence: every step has one row, which the FP8 method sends to the GEMV with 16-bit
    activations, so nothing is quantized before it; two sequences decode through the carriers."""
    routes = []
    route = fp8_methods.Fp8LinearMethod.route
    monkeypatch.setattr(fp8_methods.Fp8LinearMethod, "route",
                        staticmethod(lambda *args, **kwargs: routes.append(route(*args, **kwargs)) or routes[-1]))
    with LLM(checkpoints["block"], kvcache_block_size=16, enforce_eager=True) as llm:
        assert llm.config.torch_dtype == torch.bfloat16
        linear_inputs.clear()       # the start-up's warm-up steps
        routes.clear()
        llm.generate([[5]], GREEDY, use_tqdm=False)
        assert linear_inputs and not any(isinstance(x, QuantizedActivation) for x in linear_inputs)
        assert routes and {chosen.kernel for chosen in routes} == {"gemv"}     # gate_up's fused GEMV included
        linear_inputs.clear()
        llm.generate([[5], [7, 8]], GREEDY, use_tqdm=False)
        carriers = [x for x in linear_inputs if isinstance(x, QuantizedActivation)]
        assert carriers and all(x.q.shape[0] > GEMV_MAX_ROWS for x in carriers)
