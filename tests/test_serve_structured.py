"""Structured outputs and OpenAI's validation through the server, as clients use them: a live
`python -m nanovllm.serve` on a tiny random model with a Qwen3-style chat template, driven by the
real `openai` client. Whatever the random weights pick, every constrained answer must parse and
validate (judged by the `jsonschema` library and Python's `re`), streamed or not, n=2 too; every bad
request is a 400 naming its field, and the server serves on after each."""
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.qwen3_style_model import write_qwen3_style_model
from tests.test_serve import engine_flags, free_port, start_server, wait_ready

MODEL_NAME = "tiny-qwen3-style"
MAX_MODEL_LEN = 512
ENGINE_ARGS = dict(device="cpu", max_model_len=MAX_MODEL_LEN, kvcache_block_size=16, num_kvcache_blocks=160)
SEEDS_AND_TEMPERATURES = [(0, 0.0), (1, 0.7), (2, 1.0), (3, 1.0), (4, 1.5), (5, 0.7)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "required": ["city"],
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
}
# what no random model could write unconstrained: letters, digits and a dash in a fixed shape
ORDER_ID = r"[A-Z]{3}-[0-9]{4}"
ANSWERS = ["yes", "no", "it depends"]
GRAMMAR = 'root ::= "sum(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_qwen3_style_model(str(tmp_path_factory.mktemp("qwen3_style")))
    port = free_port()
    process = start_server(path, port, "--served-model-name", MODEL_NAME, *engine_flags(ENGINE_ARGS))
    wait_ready(process, port)
    yield f"http://127.0.0.1:{port}"
    process.kill()
    process.wait(60)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=300) as client:
        yield client


def chat(client, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(content, finish_reason) of each choice, joined from the chunks when streamed."""
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                  max_tokens=300, **kwargs)
    if not stream:
        return [(c.message.content, c.finish_reason) for c in client.chat.completions.create(**kwargs).choices]
    texts, finishes = {}, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    return [(texts[i], finishes[i]) for i in sorted(texts)]


def complete(client, **kwargs) -> list[tuple[str, str]]:
    response = client.completions.create(model=MODEL_NAME, prompt="Data:", max_tokens=200, **kwargs)
    return [(c.text, c.finish_reason) for c in response.choices]


@pytest.mark.parametrize("seed,temperature", SEEDS_AND_TEMPERATURES)
def test_json_schema_answers_validate_streamed_or_not(client, seed, temperature):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    whole = chat(client, False, n=2, seed=seed, temperature=temperature, response_format=response_format)
    streamed = chat(client, True, n=2, seed=seed, temperature=temperature, response_format=response_format)
    assert streamed == whole
    for content, finish_reason in whole:
        assert finish_reason == "stop", content
        jsonschema.validate(json.loads(content), PERSON)


@pytest.mark.parametrize("seed,temperature", SEEDS_AND_TEMPERATURES[:3])
def test_every_constraint_field_on_chat_and_completions(client, seed, temperature):
    sampling = dict(seed=seed, temperature=temperature, n=2)
    for content, finish in chat(client, False, response_format={"type": "json_object"}, **sampling):
        assert finish == "stop" and isinstance(json.loads(content), dict), content
    for content, finish in chat(client, True, extra_body={"structured_outputs": {"regex": ORDER_ID}}, **sampling):
        assert finish == "stop" and re.fullmatch(ORDER_ID, content), content
    for content, finish in complete(client, extra_body={"guided_choice": ANSWERS}, **sampling):
        assert finish == "stop" and content in ANSWERS
    for content, finish in complete(client, extra_body={"structured_outputs": {"choice": ANSWERS}}, **sampling):
        assert finish == "stop" and content in ANSWERS
    for content, finish in complete(client, extra_body={"guided_regex": ORDER_ID}, **sampling):
        assert finish == "stop" and re.fullmatch(ORDER_ID, content), content
    for content, finish in complete(client, extra_body={"guided_grammar": GRAMMAR}, **sampling):
        assert finish == "stop" and re.fullmatch(r"sum\([1-9][0-9]?(,[1-9][0-9]?)*\)", content), content
    for content, finish in complete(client, extra_body={"guided_json": PERSON}, **sampling):
        assert finish == "stop"
        jsonschema.validate(json.loads(content), PERSON)
    for content, finish in complete(client, extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": PERSON}}}, **sampling):
        assert finish == "stop"
        jsonschema.validate(json.loads(content), PERSON)


def test_text_response_format_is_unconstrained(client):
    plain = chat(client, False, seed=1, temperature=1.0, max_completion_tokens=12)
    assert chat(client, False, seed=1, temperature=1.0, max_completion_tokens=12,
                response_format={"type": "text"}) == plain


def user(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
BAD_CHATS = [
    # context length: prompt + max_tokens over max_model_len, and a prompt over it alone
    ({"messages": user(), "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"messages": user(), "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ({"messages": user("word " * 600)}, "messages"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),           # no tool_call_id
    ({"messages": user(), "logprobs": 0}, "logprobs"),
    ({"messages": user(), "logprobs": "true"}, "logprobs"),
    ({"messages": user(), "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": user(), "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": user(), "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"messages": user(), "structured_outputs": {"regex": "([a-z"}}, "structured_outputs"),
    ({"messages": user(), "structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"messages": user(), "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"messages": user(), "structured_outputs": {"json_schema": {}}}, "structured_outputs"),
    ({"messages": user(), "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"messages": user(), "response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
    ({"messages": user(), "guided_choice": []}, "guided_choice"),
    ({"messages": user(), "tools": [{"type": "function"}]}, "tools"),
    ({"messages": user(), "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"messages": user(), "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"messages": user(), "tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({"messages": user(), "tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "none"}, "tools"),
    ({"messages": user(), "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": user(), "tool_choice": "required"}, "tool_choice"),
    ({"messages": user(), "tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    # tool_choice "auto" (also the default with tools) needs --enable-auto-tool-choice, which this server lacks
    ({"messages": user(), "tools": [WEATHER_TOOL]}, "tool_choice"),
    ({"messages": user(), "tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": user(), "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, "tools"),
    ({"messages": user(), "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
]
BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": [5] * MAX_MODEL_LEN}, "prompt"),
    ({"prompt": "hi", "response_format": {"type": "yaml"}}, "response_format"),
    ({"prompt": "hi", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex"),
]


def assert_error(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error", error


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests_are_400_and_the_server_serves_on(http, body, param):
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME, **body}), param)
    answer = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": user(), "max_tokens": 3,
                                                     "guided_choice": ["fine"]})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400_and_the_server_serves_on(http, body, param):
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME, **body}), param)
    answer = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3})
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "length"


def test_context_length_message_says_the_limit(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=user(), max_tokens=MAX_MODEL_LEN)
    message = raised.value.body["message"]
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.") and \
        f"{MAX_MODEL_LEN} in the completion" in message
    prompt_tokens = client.chat.completions.create(model=MODEL_NAME, messages=user(), max_tokens=1).usage.prompt_tokens
    fits = client.chat.completions.create(model=MODEL_NAME, messages=user(), max_tokens=MAX_MODEL_LEN - prompt_tokens,
                                          temperature=0, stop=None, extra_body={"guided_choice": ["ok"]})
    assert fits.choices[0].message.content == "ok"
