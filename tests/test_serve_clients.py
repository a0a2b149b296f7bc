"""What existing clients send beyond completions and chat: vLLM's /tokenize and /detokenize, judged
against the checkpoint's tokenizer, and request `priority`; one live `python -m nanovllm.serve
--scheduling-policy priority --max-num-seqs 1` on a tiny random model."""
import json
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.test_serve import engine_flags, free_port, start_server, wait_ready

MODEL_NAME = "tiny-qwen3"
# one request runs at a time, so the order in which waiting requests are admitted shows in when they end
ENGINE_ARGS = dict(device="cpu", max_model_len=512, kvcache_block_size=16, num_kvcache_blocks=80, max_num_seqs=1,
                   scheduling_policy="priority")
TEXT = "What is the capital of France? Paris is the capital of France."
MESSAGES = [{"role": "system", "content": "Introduce yourself."},
            {"role": "user", "content": "List all prime numbers within 100."}]


@pytest.fixture(scope="module")
def path(model_paths) -> str:
    return model_paths["gqa_tied"]


@pytest.fixture(scope="module")
def tokenizer(path):
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def http(path):
    port = free_port()
    process = start_server(path, port, "--served-model-name", MODEL_NAME, *engine_flags(ENGINE_ARGS))
    try:
        wait_ready(process, port)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            yield client
    finally:
        process.kill()
        process.wait(60)


def chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_prompt(http, tokenizer, add_special_tokens):
    response = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXT,
                                            "add_special_tokens": add_special_tokens})
    assert response.status_code == 200, response.text
    expected = tokenizer.encode(TEXT, add_special_tokens=add_special_tokens)
    assert response.json() == {"count": len(expected), "max_model_len": ENGINE_ARGS["max_model_len"],
                               "tokens": expected}


def test_tokenize_returns_token_strs_when_asked(http, tokenizer):
    body = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(tokenizer.encode(TEXT))
    assert "".join(body["token_strs"]) == "".join(tokenizer.tokenize(TEXT))


@pytest.mark.parametrize("fields, template_args", [
    ({}, dict(add_generation_prompt=True)),
    ({"add_generation_prompt": False}, dict(add_generation_prompt=False)),
    ({"add_generation_prompt": False, "continue_final_message": True}, dict(continue_final_message=True)),
])
def test_tokenize_chat(http, tokenizer, fields, template_args):
    body = http.post("/tokenize", json={"messages": MESSAGES, **fields}).json()
    expected = chat_ids(tokenizer, MESSAGES, **template_args)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert "token_strs" not in body


def test_tokenize_chat_equals_the_chat_completion_prompt(http):
    tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    completion = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == len(tokens)


def test_detokenize_round_trip(http, tokenizer):
    ids = tokenizer.encode(TEXT) + [tokenizer.convert_tokens_to_ids("<|im_end|>"), len(tokenizer) - 1]
    response = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tokenizer.decode(ids)}
    assert response.json()["prompt"].startswith(TEXT)


@pytest.mark.parametrize("url, body, status, param", [
    ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": TEXT, "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
])
def test_bad_bodies_are_400s_and_the_server_keeps_working(http, tokenizer, url, body, status, param):
    message = assert_error(http.post(url, json=body), status, param)
    assert param is None or param in message or status == 404
    assert http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"] == tokenizer.encode(TEXT)


def test_invalid_json_is_a_400(http):
    assert_error(http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}),
                 400, None)


def test_priority_in_request_bodies_orders_waiting_requests(http):
    """While a long request holds the one running slot, a completion with priority 5 is queued, then
    a chat completion with priority 0: the later one, with the lower value, is admitted (and ends)
    first; a priority changes no output."""
    ended: dict[str, float] = {}
    texts: dict[str, str] = {}

    def stream(name: str, url: str, body: dict, queued: threading.Event) -> None:
        with http.stream("POST", url, json={**body, "stream": True, "temperature": 0, "ignore_eos": True}) as response:
            assert response.status_code == 200
            queued.set()                         # the headers come once the engine accepted the request
            chunks = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        ended[name] = time.monotonic()
        texts[name] = "".join(piece for chunk in chunks[:-1] for piece in delta_texts(chunk))

    requests = [("long", "/v1/completions", {"prompt": TEXT, "max_tokens": 100}),
                ("low", "/v1/completions", {"prompt": TEXT, "max_tokens": 8, "priority": 5}),
                ("high", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "priority": 0})]
    threads = []
    for name, url, body in requests:
        queued = threading.Event()
        threads.append(threading.Thread(target=stream, args=(name, url, body, queued)))
        threads[-1].start()
        assert queued.wait(60)
    for thread in threads:
        thread.join(300)
    assert ended["long"] < ended["high"] < ended["low"], ended
    plain = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True}).json()
    assert texts["low"] == plain["choices"][0]["text"]


def delta_texts(chunk: str) -> list[str]:
    choices = json.loads(chunk)["choices"]
    return [c.get("text") or c.get("delta", {}).get("content") or "" for c in choices]


@pytest.mark.parametrize("priority", ["high", 1.5, None])
def test_bad_priority_is_a_400(http, priority):
    response = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1, "priority": priority})
    assert "priority" in assert_error(response, 400, "priority")


def test_embeddings_on_a_generating_server(http):
    """/v1/embeddings needs `--runner pooling` (tests/test_embeddings.py); here a 400 that says so."""
    response = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "hi"})
    assert response.status_code == 400, response.text
    assert "--runner pooling" in response.json()["error"]["message"]
    assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}).status_code == 200
