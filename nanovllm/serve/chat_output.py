"""A chat choice's text as OpenAI's message fields: `reasoning_content` (the reasoning parser's part),
then `content` and `tool_calls` (the tool parser's reading of the rest). Streams feed it each new
piece of text; whole responses feed the whole text at once, through the same parsers."""
import functools
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.serve.protocol import ChatCompletionRequest
from nanovllm.serve.reasoning_parser import REASONING_PARSERS, ReasoningParser, qwen3
from nanovllm.serve.tool_parsers import TOOL_PARSERS, NamedCallParser, ToolParser, required_calls


@dataclass(slots=True)
class ChatOutputParsing:
    """How one request's choices are read."""
    reasoning_parser: Callable[[], ReasoningParser] | None = None
    tool_parser: Callable[[], ToolParser] | None = None
    parallel_tool_calls: bool = True           # False: only the first call is kept
    calls_finish_as_tool_calls: bool = True    # finish_reason "tool_calls" (not for a named function, as OpenAI)

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, constrained: bool, tool_call_parser: str | None,
                    reasoning_parser: str | None) -> "ChatOutputParsing":
        """The parsers a request's output goes through on a server with these parsers (tool_choice
        "auto" is only served with a tool-call parser). Calls the server constrains are JSON with
        no reasoning; under any other constraint, which holds from the first token, an output
        reasons only if it opens with <think>. `enable_thinking: false` means no reasoning."""
        mode = request.tool_mode
        tools = {"auto": TOOL_PARSERS.get(tool_call_parser), "required": required_calls, "none": None}.get(mode)
        if mode == "named":
            tools = functools.partial(NamedCallParser, request.named_tool.function.name)
        thinking = (request.chat_template_kwargs or {}).get("enable_thinking", True) is not False
        reasoning = None
        if reasoning_parser is not None and thinking and mode not in ("required", "named"):
            reasoning = qwen3 if constrained else REASONING_PARSERS[reasoning_parser]
        return cls(reasoning, tools, request.parallel_tool_calls, calls_finish_as_tool_calls=mode != "named")

    def new_choice(self) -> "ChoiceOutputParser":
        return ChoiceOutputParser(self)


class ChoiceOutputParser:
    def __init__(self, parsing: ChatOutputParsing):
        self.parsing = parsing
        self.reasoning = parsing.reasoning_parser() if parsing.reasoning_parser else None
        self.tools = parsing.tool_parser() if parsing.tool_parser else None

    def feed(self, text: str) -> dict:
        """The delta fields (only those with something new) that this piece of text settles."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._delta(reasoning, content, finished=False)

    def finish(self) -> dict:
        """The delta fields of the text held back until the end."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._delta(reasoning, content, finished=True)

    def message(self, text: str) -> dict:
        """The whole output as message fields: content (None when it is empty beside tool calls),
        reasoning_content when there is a reasoning parser, tool_calls when there is a tool parser."""
        deltas = [self.feed(text), self.finish()]
        content = "".join(d.get("content", "") for d in deltas)
        message = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(d.get("reasoning_content", "") for d in deltas) or None
        if self.tools is not None:
            calls = join_tool_call_pieces([p for d in deltas for p in d.get("tool_calls", [])])
            message["tool_calls"] = calls
            if calls and not content:
                message["content"] = None
        return message

    def finish_reason(self, engine_finish_reason: str | None) -> str | None:
        if engine_finish_reason == "stop" and self.tools_called and self.parsing.calls_finish_as_tool_calls:
            return "tool_calls"
        return engine_finish_reason

    @property
    def tools_called(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def _delta(self, reasoning: str, content: str, finished: bool) -> dict:
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if self.tools is not None:
            tool_delta = self.tools.feed(content)
            if finished:
                end = self.tools.finish()
                tool_delta.content += end.content
                tool_delta.tool_calls += end.tool_calls
            content = tool_delta.content
            pieces = [p for p in tool_delta.tool_calls if self.parsing.parallel_tool_calls or p["index"] == 0]
            if pieces:
                delta["tool_calls"] = pieces
        if content:
            delta["content"] = content
        return delta


def join_tool_call_pieces(pieces: list[dict]) -> list[dict]:
    """Whole calls from their stream pieces: id, type and name from the first, arguments joined."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        if piece["index"] not in calls:
            calls[piece["index"]] = {"id": piece["id"], "type": piece["type"],
                                     "function": {"name": piece["function"]["name"], "arguments": ""}}
        calls[piece["index"]]["function"]["arguments"] += piece["function"].get("arguments", "")
    return [calls[index] for index in sorted(calls)]
