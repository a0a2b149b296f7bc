"""Tool calls and reasoning through the server, as agent frameworks use them: a live
`python -m nanovllm.serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`
on a tiny random model with a Qwen3-style chat template, driven by the real `openai` client.

`required` and named tool choices constrain the output, so whatever the random weights pick, every
call must be a valid call whose arguments validate (judged by `jsonschema`). A random model does not
write `<tool_call>` blocks or `<think>` blocks by itself: those paths are driven by a regex that
forces such text, and the parsed fields are judged against the same text read by the test's own
regex (the parsers' cut-anywhere tests are in test_tool_parsers.py / test_reasoning_parser.py)."""
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.qwen3_style_model import write_qwen3_style_model
from tests.test_serve import engine_flags, free_port, start_server, wait_ready

MODEL_NAME = "tiny-qwen3-style"
# tools in the system prompt take about 1000 tokens of this small vocabulary
ENGINE_ARGS = dict(device="cpu", max_model_len=2048, kvcache_block_size=16, num_kvcache_blocks=1200)
SEEDS_AND_TEMPERATURES = [(0, 0.0), (1, 0.7), (2, 1.0), (3, 1.5)]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "pattern": "^[a-z ]{1,10}$"},
            "filters": {"type": "array", "items": {"type": "string", "enum": ["news", "images"]}, "maxItems": 2},
            "options": {"type": "object", "properties": {"safe": {"type": "boolean"}}, "required": ["safe"]}}}}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},        # no parameters
]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
                                                                       "additionalProperties": False})
              for t in TOOLS}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return write_qwen3_style_model(str(tmp_path_factory.mktemp("qwen3_style")))


@pytest.fixture(scope="module")
def client(path) -> openai.OpenAI:
    port = free_port()
    process = start_server(path, port, "--served-model-name", MODEL_NAME, "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", *engine_flags(ENGINE_ARGS))
    wait_ready(process, port)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
    process.kill()
    process.wait(60)


def concurrently(*calls) -> list:
    """Run the calls (functions of no arguments) at once, so the engine batches them; their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def whole_and_streamed(client, requests: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """(whole, streamed) choices of each request, all sent at once."""
    results = concurrently(*[lambda r=r, read=read: read(client, **r) for r in requests for read in (whole, streamed)])
    return list(zip(results[::2], results[1::2]))


def calls_of(tool_calls) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in tool_calls or []]


def whole(client, **kwargs) -> list[dict]:
    """Each choice of a non-streamed chat as {content, reasoning, calls, finish}."""
    response = client.chat.completions.create(model=MODEL_NAME, **{"messages": MESSAGES, "max_tokens": 300, **kwargs})
    choices = []
    for choice in response.choices:
        for call in choice.message.tool_calls or []:
            assert call.type == "function" and call.id.startswith("call_")
        choices.append(dict(content=choice.message.content or None,
                            reasoning=getattr(choice.message, "reasoning_content", None),
                            calls=calls_of(choice.message.tool_calls), finish=choice.finish_reason))
    return choices


def streamed(client, **kwargs) -> list[dict]:
    """The same from a stream: text deltas joined, tool-call pieces joined by index, each call's
    id, type and name sent once in its first piece."""
    choices = {}
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True,
                                                **{"messages": MESSAGES, "max_tokens": 300, **kwargs}):
        for c in chunk.choices:
            mine = choices.setdefault(c.index, dict(content="", reasoning="", calls={}, finish=None))
            mine["content"] += c.delta.content or ""
            mine["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            mine["finish"] = c.finish_reason or mine["finish"]
            for piece in c.delta.tool_calls or []:
                if piece.index not in mine["calls"]:
                    assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
                    mine["calls"][piece.index] = [piece.function.name, piece.function.arguments or ""]
                else:
                    assert piece.id is None and piece.function.name is None
                    mine["calls"][piece.index][1] += piece.function.arguments
    result = []
    for index in sorted(choices):
        mine = choices[index]
        assert sorted(mine["calls"]) == list(range(len(mine["calls"])))
        result.append(dict(content=mine["content"] or None, reasoning=mine["reasoning"] or None,
                           calls=[tuple(mine["calls"][i]) for i in sorted(mine["calls"])], finish=mine["finish"]))
    return result


def check_call(name: str, arguments: str) -> None:
    assert name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_named_function_calls_validate_and_stream_alike(client):
    requests = [dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}}, n=2, seed=seed,
                     temperature=temperature)
                for name in ("get_weather", "search", "now") for seed, temperature in SEEDS_AND_TEMPERATURES]
    for request, (choices, streamed_choices) in zip(requests, whole_and_streamed(client, requests)):
        assert streamed_choices == choices
        for choice in choices:
            assert choice["finish"] == "stop" and choice["content"] is None and len(choice["calls"]) == 1, choice
            assert choice["calls"][0][0] == request["tool_choice"]["function"]["name"]
            check_call(*choice["calls"][0])


def test_required_calls_validate_and_stream_alike(client):
    requests = [dict(tools=TOOLS, tool_choice="required", n=2, seed=seed, temperature=temperature,
                     parallel_tool_calls=parallel)
                for seed, temperature in SEEDS_AND_TEMPERATURES for parallel in (True, False)]
    for request, (choices, streamed_choices) in zip(requests, whole_and_streamed(client, requests)):
        assert streamed_choices == choices
        for choice in choices:
            assert choice["finish"] == "tool_calls" and choice["content"] is None and choice["calls"], choice
            assert request["parallel_tool_calls"] or len(choice["calls"]) == 1
            for call in choice["calls"]:
                check_call(*call)


# a model's own hermes-style calls, forced: content first, then one or two blocks
WRITTEN_CALLS = (r'(Let me check\.\n\n)?'
                 r'(<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Za-z]{1,8}", '
                 r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>\n?){1,2}')


def test_auto_turns_written_calls_into_tool_calls(client):
    requests = [dict(tools=TOOLS, n=2, seed=seed, temperature=temperature, extra_body={"guided_regex": WRITTEN_CALLS})
                for seed, temperature in SEEDS_AND_TEMPERATURES]
    # tool_choice "none": the same text (same prompt, same seed), not parsed; "auto" is the default
    raws = concurrently(*[lambda r=r: whole(client, **r, tool_choice="none") for r in requests])
    for raw, (parsed, streamed_parsed) in zip(raws, whole_and_streamed(client, requests)):
        assert streamed_parsed == parsed
        for text, choice in zip(raw, parsed, strict=True):
            assert re.fullmatch(WRITTEN_CALLS, text["content"]) and text["calls"] == []
            blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text["content"])
            expected = [(json.loads(b)["name"], json.dumps(json.loads(b)["arguments"])) for b in blocks]
            assert choice["calls"] == expected and choice["finish"] == "tool_calls"
            assert choice["content"] == (text["content"].split("<tool_call>")[0] or None)
            for call in choice["calls"]:
                check_call(*call)


def test_unconstrained_auto_streams_as_it_answers(client):
    """Whatever the random model writes (its vocabulary has <tool_call> and <think> tokens), the
    stream's pieces join to the whole answer."""
    requests = [dict(tools=TOOLS, n=2, seed=seed, temperature=1.0, max_tokens=40) for seed in range(4)]
    for choices, streamed_choices in whole_and_streamed(client, requests):
        assert streamed_choices == choices


THINKING = r"<think>\n[a-z ]{1,20}\n</think>\n\n[a-z ]{1,20}"


def test_reasoning_content_split_off_streamed_or_not(client):
    requests = [dict(seed=seed, temperature=temperature, n=2, extra_body={"structured_outputs": {"regex": THINKING}})
                for seed, temperature in SEEDS_AND_TEMPERATURES]
    off = [dict(r, extra_body={**r["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}) for r in requests]
    results = whole_and_streamed(client, requests)
    without_thinking = concurrently(*[lambda r=r: whole(client, **r) for r in off])
    for (choices, streamed_choices), unthinking in zip(results, without_thinking):
        assert streamed_choices == choices
        for choice in choices:
            assert re.fullmatch(r"\n[a-z ]{1,20}\n", choice["reasoning"]), choice
            assert re.fullmatch(r"\n\n[a-z ]{1,20}", choice["content"]) and choice["finish"] == "stop", choice
        for choice in unthinking:                   # no reasoning asked: the block stays content
            assert choice["reasoning"] is None and re.fullmatch(THINKING, choice["content"])


def test_history_with_calls_and_results_reaches_the_template(client, path):
    """Assistant tool_calls (content null) and tool results render as the template writes them: the
    server's prompt has as many tokens as transformers' own rendering of the same conversation."""
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    tokenizer = AutoTokenizer.from_pretrained(path)
    for kwargs in ({}, {"enable_thinking": False}):
        rendered = tokenizer.apply_chat_template(
            [dict(m, content=m["content"] or "") for m in history], tools=TOOLS, tokenize=False,
            add_generation_prompt=True, **kwargs)
        assert "<tool_response>\nnoon\n</tool_response>" in rendered and '"name": "search"' in rendered
        response = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=2,
                                                  tool_choice="none", extra_body={"chat_template_kwargs": kwargs})
        assert response.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
        assert response.choices[0].message.tool_calls is None


def test_tool_choice_none_answers_text(client):
    choice = whole(client, tools=TOOLS, tool_choice="none", seed=3, temperature=1.0, max_tokens=20)[0]
    assert choice["calls"] == [] and choice["finish"] == "length" and choice["content"]
