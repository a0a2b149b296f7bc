"""The bundled demo model's accuracy in 16 bits and written as 4-bit AWQ and GPTQ checkpoints by
round-to-nearest (nanovllm/checkpoints/quantized_checkpoint.py), through the engine: exact greedy
answers to held-out additions (`What is A + B?`, pairs the model never trained on, drawn as
tests/test_demo.py draws them) and to the capital questions of every country in every phrasing
(docs/demo_model.md says how the model was trained and measured).

--logits-error prints instead each format's first-step logits error against transformers running
the 16-bit checkpoint in float32: ||engine - reference|| / ||reference|| over the last-token logits
of the capital questions, for float32 and bfloat16, online FP8 and the 4-bit checkpoints (each in bfloat16).

    PYTHONPATH=. python scripts/quantized_demo_accuracy.py            # 200 additions, 50 x 5 capitals, on the CPU
    PYTHONPATH=. python scripts/quantized_demo_accuracy.py --additions 2000 --device cuda
    PYTHONPATH=. python scripts/quantized_demo_accuracy.py --logits-error --device cuda
"""
import argparse
import importlib.util
import json
import os
import random
import tempfile
from pathlib import Path

from nanovllm import LLM, SamplingParams
from nanovllm.demo import capitals, model_path
from nanovllm.checkpoints.quantized_checkpoint import write_awq_checkpoint, write_gptq_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def training_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", ROOT / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_accuracy(path: str, num_additions: int = 200, phrasings: int = 5, device: str = "cpu") -> tuple[float, float]:
    """(share of held-out additions answered right, share of capital questions answered right)."""
    training = training_script()
    with open(os.path.join(model_path(), "training.json")) as f:
        seed = json.load(f)["arguments"]["seed"]
    pairs = random.Random(1234).sample(training.held_out_pairs(seed), num_additions)
    countries = capitals()
    questions = training.CAPITAL_QUESTIONS[:phrasings]
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(path, device=device, kvcache_block_size=16, num_kvcache_blocks=512) as llm:
        sums = llm.chat([[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in pairs], params,
                        use_tqdm=False)
        caps = llm.chat([[{"role": "user", "content": q.format(c=country)}] for country, _ in countries
                         for q in questions], params, use_tqdm=False)
    expected = [capital for _, capital in countries for _ in questions]
    return (sum(o["text"] == str(a + b) for o, (a, b) in zip(sums, pairs)) / len(pairs),
            sum(o["text"] == c for o, c in zip(caps, expected)) / len(expected))


def capital_prompts(tokenizer) -> list[list[int]]:
    from nanovllm.engine.chat_template import apply_chat_template
    questions = training_script().CAPITAL_QUESTIONS[:5]
    return [apply_chat_template(tokenizer, [{"role": "user", "content": q.format(c=country)}], "demo")
            for country, _ in capitals() for q in questions]


def first_step_logits(path: str, prompts: list[list[int]], device: str, **engine_args):
    """The engine's logits for each prompt's next token, in float32 (one prefill step)."""
    from nanovllm.core.sequence import Sequence
    with LLM(path, device=device, kvcache_block_size=16, num_kvcache_blocks=512, **engine_args) as llm:
        for prompt in prompts:
            llm.engine.core.scheduler.add(Sequence(prompt, SamplingParams(temperature=0)))
        batch = llm.engine.core.scheduler.schedule()
        assert batch.is_prefill and len(batch.seqs) == len(prompts), "the prompts must fit one step"
        runner = llm.engine.core.executor
        logits = runner.driver.execute(runner.prepare_step(batch)).float().cpu()
    return logits


def logits_errors(tmp: str, group_size: int, device: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = model_path()
    prompts = capital_prompts(AutoTokenizer.from_pretrained(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    formats = {
        "float32": (path, dict(dtype="float32")),
        "bfloat16": (path, dict(dtype="bfloat16")),
        "online FP8 (per-channel weights, per-token activations)": (path, dict(dtype="bfloat16", quantization="fp8")),
        f"AWQ 4-bit, group {group_size}": (write_awq_checkpoint(path, f"{tmp}/awq", group_size), dict(dtype="bfloat16")),
        f"GPTQ 4-bit, group {group_size}": (write_gptq_checkpoint(path, f"{tmp}/gptq", 4, group_size),
                                            dict(dtype="bfloat16")),
    }
    print(f"| weights | first-step logits error against float32 ({len(prompts)} prompts, {device}) |\n| --- | --- |")
    for name, (checkpoint, engine_args) in formats.items():
        logits = first_step_logits(checkpoint, prompts, device, **engine_args)
        error = ((logits - reference).norm() / reference.norm()).item()
        print(f"| {name} | {error:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--additions", type=int, default=200)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--logits-error", action="store_true", help="first-step logits error of each format instead")
    args = parser.parse_args()
    if args.logits_error:
        with tempfile.TemporaryDirectory() as tmp:
            logits_errors(tmp, args.group_size, args.device)
        return
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = {
            "16-bit (bfloat16 checkpoint)": model_path(),
            f"awq 4-bit, group {args.group_size}": write_awq_checkpoint(model_path(), f"{tmp}/awq", args.group_size),
            f"gptq 4-bit, group {args.group_size}": write_gptq_checkpoint(model_path(), f"{tmp}/gptq", 4,
                                                                          args.group_size),
            f"gptq 4-bit, group {args.group_size}, act order": write_gptq_checkpoint(
                model_path(), f"{tmp}/gptq-act", 4, args.group_size, desc_act=True),
        }
        rows = [(name, *demo_accuracy(path, args.additions, device=args.device)) for name, path in checkpoints.items()]
    print(f"| weights | {args.additions} held-out additions | 50 capitals x 5 phrasings |\n| --- | --- | --- |")
    for name, sums, caps in rows:
        print(f"| {name} | {sums:.1%} | {caps:.1%} |")


if __name__ == "__main__":
    main()
