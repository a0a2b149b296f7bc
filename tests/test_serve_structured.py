"""Structured outputs and OpenAI's validation through the server, as clients use them: a live
`python -m nanovllm.serve` on a tiny random model with a Qwen3-style chat template, driven by the
real `openai` client. Whatever the random weights pick, every constrained answer must parse and
validate (judged by the `jsonschema` library and Python's `re`), streamed or not, n=2 too; every bad
request is a 400 naming its field, and the server serves on after each."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.qwen3_style_model import write_qwen3_style_model
from tests.test_serve import engine_flags, free_port, start_server, wait_ready

MODEL_NAME = "tiny-qwen3-style"
MAX_MODEL_LEN = 512
ENGINE_ARGS = dict(device="cpu", max_model_len=MAX_MODEL_LEN, kvcache_block_size=16, num_kvcache_blocks=160)
SEEDS_AND_TEMPERATURES = [(0, 0.0), (1, 0.7), (2, 1.0), (3, 1.5)]

PERSON = {      # nested object, array, enums, integer ranges, required and optional fields; short answers
    "type": "object",
    "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "home": {"type": "object", "required": ["ok"],
                 "properties": {"ok": {"type": "boolean"}, "floor": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "name": {"type": "string", "maxLength": 4},
        "code": {"type": "string", "pattern": "^[a-z]{1,3}$"},
    },
    "required": ["age", "role", "home"],
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
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=900)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=300) as client:
        yield client


def concurrently(*calls) -> list:
    """Run the calls (functions of no arguments) at once, so the engine batches them; their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def chat(client, stream: bool, **kwargs) -> list[tuple[str, str]]:
    """(content, finish_reason) of each choice, joined from the chunks when streamed."""
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Describe a person as JSON."}],
              "max_tokens": 150, **kwargs}
    if not stream:
        return [(c.message.content, c.finish_reason) for c in client.chat.completions.create(**kwargs).choices]
    texts, finishes = {}, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    return [(texts[i], finishes[i]) for i in sorted(texts)]


def complete(client, **kwargs) -> list[tuple[str, str]]:
    response = client.completions.create(**{"model": MODEL_NAME, "prompt": "Data:", "max_tokens": 150, **kwargs})
    return [(c.text, c.finish_reason) for c in response.choices]


def test_json_schema_answers_validate_streamed_or_not(client):
    """Nested objects, arrays, enums, integer ranges, required and optional fields; chat through
    response_format and vLLM's structured_outputs, streamed or not, two choices each."""
    formats = [dict(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                            "strict": True}}),
               dict(extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})]
    requests = [dict(n=2, seed=seed, temperature=temperature, **fmt)
                for seed, temperature in SEEDS_AND_TEMPERATURES for fmt in formats]
    results = concurrently(*[lambda r=r, stream=stream: chat(client, stream, **r)
                             for r in requests for stream in (False, True)])
    for whole, streamed in zip(results[::2], results[1::2]):
        assert streamed == whole
        for content, finish_reason in whole:
            assert finish_reason == "stop", content
            jsonschema.validate(json.loads(content), PERSON)


def test_every_constraint_field_on_chat_and_completions(client):
    """Each field, chat or completions, over seeds and temperatures: every answer matches."""
    cases = [  # (call, check of one (text, finish_reason))
        (lambda s: chat(client, True, extra_body={"structured_outputs": {"regex": ORDER_ID}}, **s),
         lambda text: re.fullmatch(ORDER_ID, text)),
        (lambda s: chat(client, False, extra_body={"guided_choice": ANSWERS}, **s), lambda text: text in ANSWERS),
        (lambda s: complete(client, extra_body={"guided_choice": ANSWERS}, **s), lambda text: text in ANSWERS),
        (lambda s: complete(client, extra_body={"structured_outputs": {"choice": ANSWERS}}, **s),
         lambda text: text in ANSWERS),
        (lambda s: complete(client, extra_body={"guided_regex": ORDER_ID}, **s), lambda text: re.fullmatch(ORDER_ID, text)),
        (lambda s: complete(client, extra_body={"guided_grammar": GRAMMAR}, **s),
         lambda text: re.fullmatch(r"sum\([1-9][0-9]?(,[1-9][0-9]?)*\)", text)),
        (lambda s: complete(client, extra_body={"structured_outputs": {"grammar": GRAMMAR}}, **s),
         lambda text: re.fullmatch(r"sum\([1-9][0-9]?(,[1-9][0-9]?)*\)", text)),
        (lambda s: complete(client, extra_body={"guided_json": PERSON}, **s),
         lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
        (lambda s: complete(client, extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": PERSON}}}, **s), lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    ]
    samplings = [dict(seed=seed, temperature=temperature, n=2) for seed, temperature in SEEDS_AND_TEMPERATURES[1:]]
    results = concurrently(*[lambda c=call, s=s: c(s) for call, _ in cases for s in samplings])
    checks = [check for _, check in cases for _ in samplings]
    for check, choices in zip(checks, results, strict=True):
        for text, finish_reason in choices:
            assert finish_reason == "stop" and check(text), text


def test_json_object_answers_are_objects(client):
    """Any JSON object: a random model rarely closes a free string, so only answers that finished
    can be parsed; those must be objects, the others must have begun one."""
    results = concurrently(*[lambda s=s, t=t: chat(client, False, n=2, seed=s, temperature=t, max_tokens=60,
                                                   response_format={"type": "json_object"})
                             for s, t in SEEDS_AND_TEMPERATURES])
    finished = [text for choices in results for text, finish in choices if finish == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    assert all(text.startswith("{") for choices in results for text, _ in choices)


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
    ({"messages": user(), "structured_outputs": {"json_schema": {}}}, "structured_outputs"),      # not vLLM's name
    ({"messages": user(), "structured_outputs": {}}, "structured_outputs"),
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
    answer = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": user(), "max_tokens": 8,
                                                     "guided_choice": ["fine"]})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400_and_the_server_serves_on(http, body, param):
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME, **body}), param)
    # ignore_eos: a sampled end of sequence (about 1 in 1,000 here) is not a server that stopped serving
    answer = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3,
                                                "ignore_eos": True})
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
