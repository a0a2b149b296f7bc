"""The demo model shipped inside the package: a 4.9M-parameter Qwen3 trained by
scripts/train_demo_model.py to answer `What is A + B?` (0 <= A, B <= 999) and `What is the capital
of C?` for the countries in capitals.tsv. It lets a fresh install show real answers with no download:

    from nanovllm import LLM, SamplingParams
    from nanovllm.demo import model_path
    llm = LLM(model_path())
    llm.chat([{"role": "user", "content": "What is 123 + 456?"}], SamplingParams(temperature=0))
"""
from pathlib import Path

_DIRECTORY = Path(__file__).resolve().parent


def model_path() -> str:
    """Directory of the demo checkpoint (config.json, model.safetensors, tokenizer files)."""
    return str(_DIRECTORY)


def capitals() -> list[tuple[str, str]]:
    """The (country, capital) pairs the demo model was trained on."""
    with open(_DIRECTORY / "capitals.tsv", encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    return [(country, capital) for country, capital in rows[1:]]
