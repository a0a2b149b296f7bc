"""Tool-call parsers on text streams: the text cut at every position (tags split over two pieces,
JSON arriving in pieces) and fed one character at a time joins to what parsing the whole text gives,
and that is the calls and content the text holds (judged by json.loads of the calls' JSON)."""
import json

import pytest

from nanovllm.serve.chat_output import ChatOutputParsing, join_tool_call_pieces
from nanovllm.serve.reasoning_parser import qwen3
from nanovllm.serve.tool_parsers import NamedCallParser, hermes, llama3_json, required_calls


def run(make_parser, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """(content, joined calls, raw pieces) of feeding these pieces, then finish."""
    parser = make_parser()
    content, raw = "", []
    for piece in pieces:
        delta = parser.feed(piece)
        content += delta.content
        raw += delta.tool_calls
    end = parser.finish()
    content += end.content
    raw += end.tool_calls
    return content, join_tool_call_pieces(raw), raw


def cuts(text: str) -> list[list[str]]:
    """The text in two pieces cut at every position, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def check_stream_pieces(raw: list[dict]) -> None:
    """OpenAI's delta.tool_calls shape: each call's first piece has its id, type and name, the
    following pieces only argument text; indices count up from 0."""
    seen = set()
    for piece in raw:
        index = piece["index"]
        if index not in seen:
            assert index == len(seen) and piece["id"].startswith("call_") and piece["type"] == "function"
            assert isinstance(piece["function"]["name"], str)
            seen.add(index)
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            assert piece["function"]["arguments"]


def check_parser(make_parser, text: str, content: str, calls: list[tuple[str, dict]]) -> None:
    whole_content, whole_calls, whole_raw = run(make_parser, [text])
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls] == calls
    check_stream_pieces(whole_raw)
    for pieces in cuts(text):
        got_content, got_calls, raw = run(make_parser, pieces)
        check_stream_pieces(raw)
        assert got_content == content, pieces
        assert [c["function"] for c in got_calls] == [c["function"] for c in whole_calls], pieces


WEATHER = {"city": "Paris", "days": [1, 2], "units": {"metric": True, "scale": -1.5e3}, "note": "a \"quoted\" {x}"}
HERMES_CASES = [
    ("plain text, no call", "plain text, no call", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}\n</tool_call>",
     "", [("get_weather", WEATHER)]),
    ('Let me look.\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {}}\n</tool_call>\n', "Let me look.\n\n", [("a", {"x": 1}), ("b", {})]),
    # arguments before the name, a string as the arguments, no arguments at all
    ('<tool_call>{"arguments": {"q": "<tool_call>"}, "name": "search"}</tool_call>', "", [("search", {"q": "<tool_call>"})]),
    ('<tool_call>{"name": "s", "arguments": "{\\"k\\": [true, null]}"}</tool_call>', "", [("s", {"k": [True, None]})]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", {})]),
    # not calls: they stay content
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
    # text after a call that is not whitespace is content; a truncated call keeps what arrived
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> done', " done", [("a", {"x": 1})]),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes(text, content, calls):
    check_parser(hermes, text, content, calls)


def test_hermes_truncated_call_keeps_its_name_and_the_arguments_so_far():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    for pieces in cuts(text):
        content, calls, _ = run(hermes, pieces)
        assert content == "" and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Par'}]


def test_hermes_broken_json_inside_a_block_after_the_name_ends_the_call():
    content, calls, _ = run(hermes, ['<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>tail'])
    assert [c["function"]["name"] for c in calls] == ["f"] and content == "tail"


LLAMA_CASES = [
    ("The answer is 4.", "The answer is 4.", []),
    ('{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}", "", [("get_weather", WEATHER)]),
    ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}', "",
     [("a", {"x": 1}), ("b", {"y": [2]})]),
    ('  {"name": "a", "parameters": {}} and then text', "and then text", [("a", {})]),
    ("{not a call}", "{not a call}", []),
    ("<|python", "<|python", []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json(text, content, calls):
    check_parser(llama3_json, text, content, calls)


REQUIRED_CASES = [
    ('[{"name": "a", "parameters": {"x": [1, {"y": "]"}]}}, {"name": "b", "parameters": {}}]', "",
     [("a", {"x": [1, {"y": "]"}]}), ("b", {})]),
    ('[{"name":"only","parameters":{"k":"v"}}]', "", [("only", {"k": "v"})]),
    ("no array", "no array", []),
]


@pytest.mark.parametrize("text,content,calls", REQUIRED_CASES)
def test_required_calls(text, content, calls):
    check_parser(required_calls, text, content, calls)


def test_named_call_is_the_whole_output():
    text = '{"city": "Paris", "days": 3}'
    check_parser(lambda: NamedCallParser("get_weather"), text, "", [("get_weather", {"city": "Paris", "days": 3})])
    _, calls, raw = run(lambda: NamedCallParser("get_weather"), [])       # announced even when empty
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": ""}] and len(raw) == 1


def test_choice_parser_with_reasoning_tools_and_one_call_only():
    """Reasoning first, then the tool parser on the content; parallel_tool_calls=False keeps the
    first call; finish_reason becomes tool_calls only for a normal stop."""
    text = ('<think>\nweather? use <tool_call>\n</think>\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n'
            '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    parsing = ChatOutputParsing(reasoning_parser=qwen3, tool_parser=hermes, parallel_tool_calls=False)
    whole = parsing.new_choice()
    message = whole.message(text)
    assert message["reasoning_content"] == "\nweather? use <tool_call>\n" and message["content"] == "\n\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("a", {"x": 1})]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for pieces in cuts(text):
        choice = parsing.new_choice()
        deltas = [choice.feed(p) for p in pieces] + [choice.finish()]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == message["content"]
        joined = join_tool_call_pieces([p for d in deltas for p in d.get("tool_calls", [])])
        assert [c["function"] for c in joined] == [c["function"] for c in message["tool_calls"]]
    named = ChatOutputParsing(tool_parser=lambda: NamedCallParser("f"), calls_finish_as_tool_calls=False).new_choice()
    assert named.message("{}")["content"] is None and named.finish_reason("stop") == "stop"
    plain = ChatOutputParsing(tool_parser=hermes).new_choice()
    assert plain.message("hello") == {"role": "assistant", "content": "hello", "tool_calls": []}
