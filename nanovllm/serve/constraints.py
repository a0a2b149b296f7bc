"""What a request constrains its output to, as the engine's StructuredOutputsParams: OpenAI's
`response_format`, vLLM's `structured_outputs` and its older `guided_*` fields, or the calls that
`tool_choice: "required"` or a named function demand (vLLM's way: a named function's output is its
arguments object under the function's parameters schema; "required" is a JSON array of
{"name": one of the tools, "parameters": that tool's arguments}).

JSON held to a schema leaves no optional whitespace (separators ", " and ": " only), except where
`structured_outputs.disable_any_whitespace` says otherwise: random or weak models loop on optional
whitespace and never finish, and OpenAI's fields give a client no way to ask for it."""
from dataclasses import dataclass

from nanovllm.serve.errors import APIError
from nanovllm.serve.protocol import ChatCompletionRequest, ChatCompletionTool, SamplingFields
from nanovllm.structured_outputs import StructuredOutputsParams

REQUEST_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar")
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(slots=True)
class Constraint:
    params: StructuredOutputsParams
    field: str          # the request field it came from: errors name it


def output_constraint(request: SamplingFields) -> Constraint | None:
    """The constraint a request asks for; a 400 naming the field for two of them or a bad one."""
    tool_constraint = tool_call_constraint(request) if isinstance(request, ChatCompletionRequest) else None
    given = [name for name in REQUEST_FIELDS if _asks(request, name)]
    if tool_constraint is not None and given:
        raise APIError(400, f"tool_choice {request.tool_mode!r} constrains the output itself; "
                            f"it cannot be combined with {given[0]}", param="tool_choice")
    if len(given) > 1:
        raise APIError(400, f"{given[1]} cannot be combined with {given[0]}: give one constraint", param=given[1])
    if tool_constraint is not None:
        return tool_constraint
    if not given:
        return None
    field = given[0]
    try:
        return Constraint(_params(request, field), field)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"{field}: {e}", param=field)


def _asks(request: SamplingFields, name: str) -> bool:
    value = getattr(request, name)
    return value is not None and not (name == "response_format" and value.type == "text")


def _params(request: SamplingFields, field: str) -> StructuredOutputsParams:
    if field == "response_format":
        fmt = request.response_format
        schema = fmt.json_schema.json_schema if fmt.json_schema else None
        if schema is None:
            return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if field == "structured_outputs":
        given = request.structured_outputs
        return StructuredOutputsParams(json=given.json_schema, json_object=given.json_object, regex=given.regex,
                                       choice=given.choice, grammar=given.grammar,
                                       disable_any_whitespace=given.disable_any_whitespace)
    kind = field.removeprefix("guided_")
    return StructuredOutputsParams(**{kind: getattr(request, field)}, disable_any_whitespace=kind == "json")


def tool_call_constraint(request: ChatCompletionRequest) -> Constraint | None:
    """The JSON a `required` or named tool_choice holds the output to. Random or weak models loop on
    optional whitespace inside JSON, so these leave none."""
    if request.tool_mode == "named":
        schema = _arguments_schema(request.named_tool)
    elif request.tool_mode == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [_call_schema(t) for t in request.tools]}}
        if not request.parallel_tool_calls:
            schema["maxItems"] = 1
    else:
        return None
    return Constraint(StructuredOutputsParams(json=schema, disable_any_whitespace=True), "tools")


def _arguments_schema(tool: ChatCompletionTool) -> dict:
    return tool.function.parameters or NO_ARGUMENTS


def _call_schema(tool: ChatCompletionTool) -> dict:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                             "parameters": _arguments_schema(tool)},
            "required": ["name", "parameters"], "additionalProperties": False}
