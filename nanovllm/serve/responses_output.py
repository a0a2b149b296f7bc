"""A Responses API output, as its stream of events and as the whole response.

The output's text is read by the chat path's parsers (serve/chat_output.py): reasoning becomes a
`reasoning` item, content a `message` item with one `output_text` part, each tool call a
`function_call` item. Text is fed piece by piece and each piece answers the events it settles
(response.output_item.added, response.content_part.added, response.output_text.delta, ...); a
whole response feeds its whole text at once, so both give the same items.
"""
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from nanovllm.async_llm import EngineClosedError, EngineDeadError, RequestStream
from nanovllm.serve.chat_output import ChoiceOutputParser
from nanovllm.serve.choices import merge_choices
from nanovllm.serve.responses_api import ResponsesRequest


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesOutput:
    """One response: its envelope, its output items and the events that build them."""

    def __init__(self, request: ResponsesRequest, model: str, parser: ChoiceOutputParser, max_output_tokens: int,
                 temperature: float, top_p: float):
        self.request = request
        self.model = model
        self.parser = parser
        self.id = new_item_id("resp")
        self.created_at = int(time.time())
        self.max_output_tokens = max_output_tokens
        self.temperature, self.top_p = temperature, top_p
        self.items: list[dict] = []         # output items so far (the last one may be open)
        self.open: dict | None = None       # the item being written
        self.sequence_number = 0
        self.call_items: dict[int, dict] = {}   # tool call index -> its function_call item

    # ---- the whole response ------------------------------------------------------------------

    def response(self, status: str = "completed", usage: dict | None = None) -> dict:
        request = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "metadata": request.metadata, "model": self.model,
            "output": [dict(item) for item in self.items],
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": self.temperature, "top_p": self.top_p,
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
            "background": False, "max_output_tokens": self.max_output_tokens, "max_tool_calls": None,
            "previous_response_id": None, "prompt": None, "reasoning": request.reasoning,
            "service_tier": request.service_tier or "auto", "store": False,
            "text": request.text.model_dump(by_alias=True, exclude_none=True) if request.text
            else {"format": {"type": "text"}},
            "top_logprobs": None, "truncation": "disabled", "usage": usage, "user": request.user,
        }

    def whole(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        """The non-streamed response to an output's whole text."""
        self.feed(text)
        self.finish()
        return self.response(status_of(finish_reason), usage)

    # ---- events ------------------------------------------------------------------------------

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, text: str) -> list[dict]:
        """The events this new piece of text settles."""
        return self._delta(self.parser.feed(text)) if text else []

    def finish(self) -> list[dict]:
        """The events of the text held back until the end, and those closing the last item."""
        events = self._delta(self.parser.finish())
        if not self.items:                  # an empty output is still one (empty) message
            events += self._open_message()
        return events + self._close()

    def completed(self, finish_reason: str | None, usage: dict) -> dict:
        return self._event("response.completed", response=self.response(status_of(finish_reason), usage))

    def _delta(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                events += self._close()
                events += self._add({"id": new_item_id("rs"), "type": "reasoning", "summary": [],
                                     "content": [{"type": "reasoning_text", "text": ""}], "encrypted_content": None,
                                     "status": "in_progress"})
            self.open["content"][0]["text"] += delta["reasoning_content"]
            events.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0,
                                      delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._close() + self._open_message()
            self.open["content"][0]["text"] += delta["content"]
            events.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                      delta=delta["content"], logprobs=[]))
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in self.call_items:
                events += self._close()
                events += self._add({"id": new_item_id("fc"), "type": "function_call", "call_id": piece["id"],
                                     "name": piece["function"]["name"], "arguments": "", "status": "in_progress"})
                self.call_items[piece["index"]] = self.open
            arguments = piece["function"].get("arguments", "")
            if arguments:
                item = self.call_items[piece["index"]]
                item["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=arguments))
        return events

    def _open_message(self) -> list[dict]:
        events = self._add({"id": new_item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                            "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open["content"].append(part)
        events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=dict(part)))
        return events

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        added = {**item, "content": []} if "content" in item else dict(item)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=added)]

    def _close(self) -> list[dict]:
        """The events ending the open item."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        events = []
        if item["type"] == "reasoning":
            events.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                      text=item["content"][0]["text"]))
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                      logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=where["output_index"],
                                  item=_copy(item)))
        return events

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def responses_usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item["content"]]} if "content" in item else dict(item)


def event_sse(event: dict) -> str:
    """One server-sent event of a Responses stream: named by its type, no [DONE] at the end."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def stream_events(output: ResponsesOutput, stream: RequestStream,
                        on_finished: Callable[[dict], None]) -> AsyncIterator[str]:
    """The events of one response as its engine request's text arrives; an engine failure or an
    aborted request ends the stream with an `error` event."""
    for event in output.start():
        yield event_sse(event)
    try:
        async for _, out in merge_choices([stream], 1, on_finished):
            if out["finish_reason"] == "abort":
                yield event_sse(output._event("error", code="aborted", message="the request was aborted", param=None))
                return
            for event in output.feed(out["delta_text"]):
                yield event_sse(event)
            if out["finished"]:
                for event in output.finish():
                    yield event_sse(event)
                usage = responses_usage(len(out["prompt_token_ids"]), len(out["token_ids"]),
                                        out.get("num_cached_tokens") or 0)
                yield event_sse(output.completed(out["finish_reason"], usage))
    except (EngineDeadError, EngineClosedError) as e:
        yield event_sse(output._event("error", code="server_error", message=str(e), param=None))
