"""Rollout control over HTTP (`--enable-rollout-endpoints`, docs/rollout.md): a live server on a
tiny model A, driven by the `openai` client and raw HTTP, judged against fresh offline engines on A
and on B; without the flag the endpoints are 404."""
import threading
import time

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.checkpoints.random_checkpoint import write_tiny_model
from tests.test_serve import engine_flags, running_server

torch.set_num_threads(1)
ENGINE_ARGS = dict(device="cpu", max_model_len=256, kvcache_block_size=16, num_kvcache_blocks=64)
PROMPTS = ["The weights of a policy", "Reward goes up when"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("serve_rollout")
    return {"a": write_tiny_model(str(root / "a"), seed=21), "b": write_tiny_model(str(root / "b"), seed=22)}


@pytest.fixture(scope="module")
def reference(paths) -> dict[str, list[list[int]]]:
    """Greedy token ids of each prompt from fresh engines on A and on B."""
    out = {}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name in ("a", "b"):
        with LLM(paths[name], **ENGINE_ARGS) as llm:
            out[name] = [o["token_ids"] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert out["a"] != out["b"]
    return out


@pytest.fixture(scope="module")
def server(paths):
    with running_server(paths["a"], "--enable-rollout-endpoints", *engine_flags(ENGINE_ARGS)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def completions(client: openai.OpenAI) -> list[list[int]]:
    response = client.completions.create(model=None, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    return [choice.token_ids for choice in response.choices]


def test_return_token_ids(client, paths, reference):
    tokenizer = AutoTokenizer.from_pretrained(paths["a"])
    response = client.completions.create(model=None, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    for choice, prompt, want in zip(response.choices, PROMPTS, reference["a"], strict=True):
        assert choice.prompt_token_ids == tokenizer.encode(prompt)
        assert choice.token_ids == want
        assert choice.text == tokenizer.decode(want)
    plain = client.completions.create(model=None, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert "token_ids" not in (plain.choices[0].model_extra or {})           # only when asked

    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=None, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert chat.prompt_token_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                  tokenize=True, return_dict=False)
    assert len(chat.choices[0].token_ids) == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=None, prompt="x", stream=True, extra_body={"return_token_ids": True})
    assert error.value.body["param"] == "return_token_ids"


def test_update_weights_from_disk_sleep_wake_and_version(client, http, paths, reference):
    assert http.get("/weight_version").json() == {"weight_version": 0}
    assert completions(client) == reference["a"]

    answer = http.post("/update_weights_from_disk", json={"model_path": paths["b"]})
    assert answer.status_code == 200 and answer.json()["weight_version"] == 1
    assert http.get("/weight_version").json() == {"weight_version": 1}
    assert completions(client) == reference["b"]

    for body, param in (({"model_path": "/nonexistent"}, "model_path"), ({}, "model_path")):
        bad = http.post("/update_weights_from_disk", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    assert http.get("/weight_version").json() == {"weight_version": 1}      # nothing changed

    assert http.post("/reset_prefix_cache").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    bad = http.post("/sleep", params={"level": "7"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
    assert http.post("/sleep", params={"level": "1"}).status_code == 200       # vLLM's query parameter
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    asleep = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    assert http.post("/wake_up", json={"tags": ["weights", "kv_cache"]}).json() == {"is_sleeping": False}
    assert completions(client) == reference["b"]                               # unchanged by the round trip

    assert http.post("/sleep", json={"level": 2}).status_code == 200           # weights dropped
    assert http.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
    assert http.post("/update_weights_from_disk", json={"model_path": paths["a"]}).json()["weight_version"] == 2
    assert http.post("/wake_up", json={"tags": ["kv_cache"]}).json() == {"is_sleeping": False}
    assert completions(client) == reference["a"]


def test_pause_and_resume(client, http, reference):
    assert http.post("/pause").json() == {"paused": True}
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("ids", completions(client)))
    thread.start()
    time.sleep(1.5)
    assert "ids" not in done                       # queued while paused
    assert http.post("/resume").json() == {"paused": False}
    thread.join(60)
    assert done["ids"] == reference["a"]


def test_endpoints_404_without_the_flag():
    """The app without enable_rollout_endpoints (routes are all the flag changes), in process."""
    from nanovllm.serve.app import build_app

    class Idle:                                    # what build_app reads of an AsyncLLM
        is_alive = True

        @staticmethod
        def stats():
            return {}

    for flag, status in ((False, 404), (True, None)):
        app = build_app(Idle(), "m", enable_rollout_endpoints=flag)
        paths = {route.path for route in app.routes}
        rollout = {"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/update_weights_from_disk",
                   "/pause", "/resume", "/weight_version"}
        assert (rollout <= paths) == flag
        if not flag:
            with TestClient(app) as test_client:
                for path in sorted(rollout):
                    method = test_client.get if path in ("/is_sleeping", "/weight_version") else test_client.post
                    answer = method(path)
                    assert answer.status_code == status and "error" in answer.json()
