"""Hugging Face repo ids as `model`, resolved offline from a cache laid out as huggingface_hub lays it out."""
import os
import shutil
import time

import huggingface_hub.constants
import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.serve.cli import parse_args
from tests.conftest import mixed_prompts

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the network: huggingface_hub reads HF_HUB_OFFLINE when imported."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def hub_cache(model_paths, tmp_path_factory) -> str:
    """models--tiny-org--tiny-qwen3/{refs/main, snapshots/COMMIT/...}: what snapshot_download leaves."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--tiny-org--tiny-qwen3"
    shutil.copytree(model_paths["mha_untied"], repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)      # no newline: huggingface_hub reads it as it is
    return str(cache)


def test_repo_id_from_cache_equals_local_directory(hub_cache, model_paths):
    local = LLM(model_paths["mha_untied"], kvcache_block_size=16)
    prompts = mixed_prompts(local.config.hf_config.vocab_size, lengths=(5, 30, 12))
    expected = [o["token_ids"] for o in local.generate(prompts, GREEDY, use_tqdm=False)]
    expected_text = local.generate(["Paris is the capital"], GREEDY, use_tqdm=False)[0]["text"]
    del local
    llm = LLM("tiny-org/tiny-qwen3", download_dir=hub_cache, kvcache_block_size=16)
    assert os.path.realpath(llm.config.model) == os.path.realpath(os.path.join(
        hub_cache, "models--tiny-org--tiny-qwen3", "snapshots", COMMIT))
    assert [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert llm.generate(["Paris is the capital"], GREEDY, use_tqdm=False)[0]["text"] == expected_text   # its tokenizer
    pinned = Config.from_engine_args("tiny-org/tiny-qwen3", download_dir=hub_cache, revision=COMMIT)
    assert pinned.model == llm.config.model


def test_repo_id_as_draft_model(hub_cache, model_paths):
    config = Config.from_engine_args(model_paths["mha_untied"], download_dir=hub_cache, speculative_config={
        "model": "tiny-org/tiny-qwen3", "num_speculative_tokens": 2})
    assert os.path.realpath(config.speculative_config.model) == os.path.realpath(os.path.join(
        hub_cache, "models--tiny-org--tiny-qwen3", "snapshots", COMMIT))
    with pytest.raises(ValueError, match="speculative_config: draft model: 'tiny-org/tiny-qwen3'.*revision 'v2'"):
        Config.from_engine_args(model_paths["mha_untied"], download_dir=hub_cache, speculative_config={
            "model": "tiny-org/tiny-qwen3", "num_speculative_tokens": 2, "revision": "v2"})


@pytest.mark.parametrize("model, kwargs, words", [
    ("tiny-org/no-such-model", {}, "HF_HUB_OFFLINE is set"),
    ("tiny-org/tiny-qwen3", dict(revision="v2"), "at revision 'v2'"),
    ("/no/such/dir", {}, "not a local directory, nor a Hugging Face repo id"),
])
def test_unknown_repo_offline_is_a_quick_value_error(hub_cache, model, kwargs, words):
    start = time.monotonic()
    with pytest.raises(ValueError, match="^model: ") as error:
        LLM(model, download_dir=hub_cache, **kwargs)
    assert words in str(error.value)
    assert time.monotonic() - start < 5


def test_unknown_repo_without_download_dir_names_model(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="model: 'tiny-org/tiny-qwen3' is not a local directory"):
        LLM("tiny-org/tiny-qwen3")


def test_bad_hub_argument_types(model_paths):
    for name in ("revision", "download_dir"):
        with pytest.raises(TypeError, match=name):
            LLM(model_paths["gqa_tied"], **{name: 3})


def test_serve_flags():
    args, engine_args = parse_args(["tiny-org/tiny-qwen3", "--revision", COMMIT, "--download-dir", "/models"])
    assert args.model == "tiny-org/tiny-qwen3"
    assert engine_args == {"revision": COMMIT, "download_dir": "/models"}
