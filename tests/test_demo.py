"""The bundled demo model: real answers through the engine, agreement with transformers, and the
files really ship in the wheel."""
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo import capitals, model_path

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _training_script():
    spec = importlib.util.spec_from_file_location("train_demo_model", REPO / "scripts" / "train_demo_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def training():
    return _training_script()


@pytest.fixture(scope="module")
def seed() -> int:
    with open(os.path.join(model_path(), "training.json")) as f:
        return json.load(f)["arguments"]["seed"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model_path(), device="cpu", kvcache_block_size=16, num_kvcache_blocks=512)
    yield engine
    engine.shutdown()


def _ask(llm, questions: list[str]) -> list[dict]:
    return llm.chat([[{"role": "user", "content": q}] for q in questions], GREEDY, use_tqdm=False)


def test_shipped_files_are_a_small_16_bit_qwen3():
    directory = Path(model_path())
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config.get("dtype", config.get("torch_dtype")) in ("bfloat16", "float16")
    assert sum(f.stat().st_size for f in directory.iterdir() if f.is_file()) <= 25 * 2**20
    eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(model_path()).convert_tokens_to_ids("<|im_end|>") in eos


def test_held_out_pairs_are_never_sampled_for_training(training, seed):
    held_out = set(training.held_out_pairs(seed))
    assert len(held_out) == training.NUM_HELD_OUT
    sampler = training.ConversationSampler(seed, training.read_capitals(), capital_share=0.0)
    questions = [sampler.sample()[0] for _ in range(20000)]
    trained = {tuple(int(n) for n in training.re.findall(r"\d+", q)) for q in questions}
    assert not trained & held_out
    # The sampler does reach every region of the grid, so the check above is not vacuous.
    assert {a // 100 for a, _ in trained} == set(range(10))


def test_held_out_additions(llm, training, seed):
    pairs = random.Random(1234).sample(training.held_out_pairs(seed), 200)
    outputs = _ask(llm, [f"What is {a} + {b}?" for a, b in pairs])
    correct = sum(out["text"] == str(a + b) and out["finish_reason"] == "stop" for out, (a, b) in zip(outputs, pairs))
    assert correct / len(pairs) >= 0.95, correct


def test_every_capital(llm):
    table = capitals()
    assert len(table) == 50
    outputs = _ask(llm, [f"What is the capital of {country}?" for country, _ in table])
    wrong = [(country, capital, out["text"]) for (country, capital), out in zip(table, outputs) if out["text"] != capital]
    assert not wrong


def test_transformers_greedy_generate_agrees(llm):
    from transformers import AutoModelForCausalLM

    rng = random.Random(7)
    questions = [f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}?" for _ in range(8)]
    questions += [f"What's {rng.randint(0, 99)} plus {rng.randint(0, 9)}?" for _ in range(4)]
    questions += [f"Which city is the capital of {country}?" for country, _ in rng.sample(capitals(), 6)]
    outputs = _ask(llm, questions)
    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id)
    for question, output in zip(questions, outputs):
        prompt = llm.apply_chat_template([{"role": "user", "content": question}])
        with torch.no_grad():
            generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8)[0, len(prompt):].tolist()
        end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        assert generated[end - 1] in eos, question
        assert output["token_ids"] == generated[:end], question


def test_wheel_carries_the_demo_model(tmp_path):
    # Build from a clean copy: an in-tree build/ folder could carry stale files into the wheel.
    source = tmp_path / "source"
    shutil.copytree(REPO / "nanovllm", source / "nanovllm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("nanovllm-*.whl")
    assert "nanovllm/demo/model.safetensors" in zipfile.ZipFile(wheel).namelist()
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        "import os, nanovllm\n"
        "from nanovllm import LLM, SamplingParams\n"
        "from nanovllm.demo import model_path\n"
        f"assert nanovllm.__file__.startswith({str(target)!r}), nanovllm.__file__\n"
        "assert os.path.isfile(os.path.join(model_path(), 'model.safetensors'))\n"
        "llm = LLM(model_path(), device='cpu', kvcache_block_size=16, num_kvcache_blocks=64)\n"
        "out = llm.chat([{'role': 'user', 'content': 'What is 321 + 789?'}], SamplingParams(temperature=0),"
        " use_tqdm=False)\n"
        "print('ANSWER', out[0]['text'])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    result = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ANSWER 1110" in result.stdout
