"""`POST /v1/responses` requests (OpenAI's Responses API as vLLM serves it), read as the chat
completion they amount to: `instructions` become a system message first, `input` items become chat
messages (a `function_call` item an assistant message's tool call, a `function_call_output` item a
tool message), function `tools` and `tool_choice` the chat fields of the same meaning, and
`text.format` json_schema a `response_format`. The chat path then does the rest (chat template,
constraints, tool and reasoning parsers).

Nothing is stored: `store: true`, `previous_response_id`, `background`, built-in tools and the other
fields nanovllm cannot honour are a 400 naming the field."""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from nanovllm.serve.errors import APIError
from nanovllm.serve.protocol import ChatCompletionRequest

# chat fields as the Responses API names them, for errors raised on the chat request
CHAT_TO_RESPONSES_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                            "max_tokens": "max_output_tokens", "response_format": "text"}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None      # only the neutral value


class ResponsesRequest(BaseModel):
    """The body of POST /v1/responses. Fields clients send with their neutral value are accepted."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: StrictStr | list[dict]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: StrictInt = 0
    # accepted at their neutral value only (see unsupported_fields)
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    stream_options: dict | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def unsupported_fields(request: ResponsesRequest) -> None:
    """A 400 naming the first field given with a value nanovllm cannot honour."""
    refusals = [
        ("store", request.store is True, "store: true is not supported: this server stores no responses "
                                         "(send store: false)"),
        ("background", bool(request.background), "background responses are not supported"),
        ("previous_response_id", request.previous_response_id is not None,
         "previous_response_id is not supported: this server stores no responses; send the whole "
         "conversation as input items"),
        ("conversation", request.conversation is not None, "conversation is not supported: this server stores "
                                                           "no conversations"),
        ("prompt", request.prompt is not None, "prompt templates are not supported"),
        ("include", bool(request.include), f"include {request.include} is not supported"),
        ("truncation", request.truncation not in (None, "disabled"), "truncation 'auto' is not supported"),
        ("service_tier", request.service_tier not in (None, "auto", "default"),
         f"service_tier {request.service_tier!r} is not supported"),
        ("max_tool_calls", request.max_tool_calls is not None, "max_tool_calls is not supported"),
        ("top_logprobs", bool(request.top_logprobs), "top_logprobs is not supported on /v1/responses"),
        ("stream_options", request.stream_options is not None and not request.stream,
         "stream_options is only allowed with stream=true"),
        ("reasoning", any(v is not None for k, v in (request.reasoning or {}).items()),
         "reasoning options (effort, summary) are not supported: reasoning comes from the server's "
         "--reasoning-parser"),
    ]
    for field, refused, message in refusals:
        if refused:
            raise APIError(400, message, param=field)


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion this Responses request amounts to; a 400 naming the Responses field
    for anything it cannot be."""
    unsupported_fields(request)
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) \
        + input_messages(request.input)
    body = {"messages": messages, "stream": bool(request.stream), "priority": request.priority,
            "max_completion_tokens": request.max_output_tokens, "seed": request.seed, "stop": request.stop,
            "tools": [chat_tool(tool, i) for i, tool in enumerate(request.tools)] if request.tools else None,
            "tool_choice": chat_tool_choice(request.tool_choice)}
    for name in ("temperature", "top_p", "top_k", "parallel_tool_calls", "user"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    fmt = request.text.format if request.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.name is None or fmt.json_schema is None:
            raise APIError(400, "text.format of type 'json_schema' needs a name and a schema", param="text")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(part) for part in first["loc"]]
        message = first["msg"].removeprefix("Value error, ")
        param = CHAT_TO_RESPONSES_FIELDS.get(loc[0], loc[0]) if loc else _field_in(message)
        raise APIError(400, f"{'.'.join([param, *loc[1:]])}: {message}" if loc else message, param)


def responses_error(error: APIError) -> APIError:
    """An error of the chat path, naming the Responses API's field."""
    error.param = CHAT_TO_RESPONSES_FIELDS.get(error.param, error.param)
    return error


def _field_in(message: str) -> str | None:
    first = message.split()[0] if message.split() else ""
    return CHAT_TO_RESPONSES_FIELDS.get(first, first) if first in ChatCompletionRequest.model_fields else None


def chat_tool(tool: dict, index: int) -> dict:
    """A Responses function tool {type, name, description, parameters, strict} in the chat shape."""
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{index}]: only function tools are supported, not {tool.get('type')!r} "
                            "(no built-in tools)", param="tools")
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise APIError(400, f"tools[{index}]: unknown fields {sorted(unknown)}", param="tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}, '
                        f"not {choice!r}", param="tool_choice")


def input_messages(given: str | list[dict]) -> list[dict]:
    """Chat messages of the Responses `input`: a string is one user message; items are messages
    (role and content), function_call items (consecutive ones one assistant message's tool calls),
    function_call_output items (tool messages) and reasoning items (the next assistant message's
    reasoning_content)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise APIError(400, "input is empty", param="input")
    messages: list[dict] = []
    reasoning = None
    for index, item in enumerate(given):
        kind = item.get("type", "message")
        where = f"input[{index}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}: role must be user, system, developer or assistant, not {role!r}",
                               param="input")
            message = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            missing = [k for k in ("call_id", "name", "arguments") if not isinstance(item.get(k), str)]
            if missing:
                raise APIError(400, f"{where}: a function_call item needs {missing} (strings)", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output item needs its call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), where)})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = "".join(part.get("text", "") for part in parts if isinstance(part, dict))
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (messages, "
                                "function_call, function_call_output and reasoning are)", param="input")
    return messages


def _text(content, where: str) -> str:
    """Message content: a string, or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}: only text content parts are supported, not {kind!r}", param="input")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"{where}: content must be a string or a list of input_text parts", param="input")
