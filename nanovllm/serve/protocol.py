"""Request bodies of the OpenAI-compatible API, as pydantic models.

Fields OpenAI defines but nanovllm does not implement are refused (400 naming them) rather than
silently ignored, except a few that clients send with their neutral value.
"""
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or JSON under a schema."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type 'json_schema'")
        return self


class StructuredOutputsFields(BaseModel):
    """vLLM's `structured_outputs` request field (nanovllm.StructuredOutputsParams)."""
    model_config = ConfigDict(extra="forbid")
    json_schema: dict | StrictStr | None = Field(None, alias="json")
    json_object: bool = False
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    disable_any_whitespace: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share: the model and how to sample."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: StrictInt = 0         # lower first, when the server runs with --scheduling-policy priority
    return_token_ids: bool | None = None     # vLLM's: prompt_token_ids and each choice's token_ids (serve/token_ids.py)
    # accepted only at their neutral value: nanovllm has no penalties
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # what the output must match (at most one of these; see serve/constraints.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @model_validator(mode="after")
    def _no_penalties(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name} is not supported (only 0)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: int | None = None
    echo: bool = False              # the prompt (and, with logprobs, its tokens' logprobs) first
    prompt_logprobs: int | None = None      # vLLM's: each choice's prompt_logprobs

    @model_validator(mode="after")
    def _echo_and_prompt_logprobs(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 only with echo=true), got 0")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream=true")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream=true")
        return self

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: as asked, or with echo and logprobs, logprobs'."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string or token ids each)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str                  # JSON text


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made, as the history sends it back."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")    # name, reasoning_content, ... go to the chat template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_with_their_roles(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message with role 'tool' needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: text content, and calls' arguments as objects
        (most templates write them with tojson)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {**self.model_dump(exclude_none=True), "content": content or ""}
        for call in message.get("tool_calls", []):
            arguments = call["function"]["arguments"]
            try:
                call["function"]["arguments"] = json.loads(arguments)
            except ValueError:
                pass                            # not JSON: the template gets the text
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")        # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None      # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_choice_among_tools(self):
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError(f"tools name a function twice: {names}")
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice {self.tool_mode!r} needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, "
                             f"which is not among the tools ({names})")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto (the default with tools), required, or named (see named_tool)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @property
    def named_tool(self) -> "ChatCompletionTool | None":
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next(tool for tool in self.tools if tool.function.name == self.tool_choice.function.name)

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or how many alternatives beside the chosen token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize body for a prompt."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's /tokenize body for a conversation: the ids a chat completion would be prompted with."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False            # the template writes them
    return_token_strs: bool = False
    tools: list[ChatCompletionTool] | None = None
    chat_template_kwargs: dict | None = None

    @model_validator(mode="after")
    def _generation_prompt_or_continuation(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: TokenIds
