"""Reasoning parsers on text streams: cut at every position (a tag split over two pieces) and fed
one character at a time, the pieces join to the one-piece split, which is the expected one."""
import pytest

from nanovllm.serve.reasoning_parser import deepseek_r1, qwen3


def split(make_parser, pieces: list[str]) -> tuple[str, str]:
    parser = make_parser()
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = parser.feed(piece) if piece is not None else parser.finish()
        reasoning += r
        content += c
    return reasoning, content


CASES = [
    (qwen3, "<think>\nLet me think.\n</think>\n\nThe answer.", "\nLet me think.\n", "\n\nThe answer."),
    (qwen3, "No thinking here, not even </think>.", "", "No thinking here, not even </think>."),
    (qwen3, "<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"),
    (qwen3, "<think>cut short <thi", "cut short <thi", ""),                 # never closed: all reasoning
    (qwen3, "a <thin", "", "a <thin"),
    (qwen3, "<thin", "", "<thin"),
    (qwen3, "text first <think>x</think>", "", "text first <think>x</think>"),   # only an opening block
    (qwen3, '{"a": "<think>"}', "", '{"a": "<think>"}'),
    (qwen3, "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),  # one block only
    (deepseek_r1, "<think>\nreason\n</think>answer", "\nreason\n", "answer"),
    (deepseek_r1, "reason without the opening tag</think>\nanswer", "reason without the opening tag", "\nanswer"),
    (deepseek_r1, "still reasoning when cut off <", "still reasoning when cut off <", ""),
    (deepseek_r1, "<thi", "<thi", ""),
    (deepseek_r1, "", "", ""),
]


@pytest.mark.parametrize("make_parser,text,reasoning,content", CASES)
def test_split_at_every_position_joins_to_the_whole(make_parser, text, reasoning, content):
    assert split(make_parser, [text]) == (reasoning, content)
    for i in range(len(text) + 1):
        assert split(make_parser, [text[:i], text[i:]]) == (reasoning, content), i
    assert split(make_parser, list(text)) == (reasoning, content)
