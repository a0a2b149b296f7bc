"""The OpenAI-compatible HTTP app: routes over one AsyncLLM."""
import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from nanovllm.async_llm import AsyncLLM, EngineClosedError, EngineDeadError
from nanovllm.engine.rollout import EngineAsleepError
from nanovllm.engine.chat_template import apply_chat_template
from nanovllm.serve.chat_output import ChatOutputParsing
from nanovllm.serve.choices import merge_choices, start_choices
from nanovllm.serve.constraints import Constraint, output_constraint
from nanovllm.serve.echo import echo_response
from nanovllm.serve.embeddings import EmbeddingRequest, embedding_response
from nanovllm.serve.errors import APIError, error_body, error_response, install_error_handlers, request_field_error
from nanovllm.serve.metrics import ServerMetrics
from nanovllm.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                                    TokenizeChatRequest, TokenizeCompletionRequest)
from nanovllm.serve.responses import ResponseBuilder, sse
from nanovllm.serve.responses_api import ResponsesRequest, chat_request, responses_error
from nanovllm.serve.responses_output import ResponsesOutput, responses_usage, stream_events
from nanovllm.serve.rollout_routes import add_rollout_routes
from nanovllm.serve.sampling import sampling_params
from nanovllm.serve.token_ids import add_token_ids, check_return_token_ids

CHAT_PAGE = Path(__file__).with_name("chat_page.html")


class ChoicesStreamingResponse(StreamingResponse):
    """Server-sent events that abort their engine requests however the response ends, also when
    the client leaves before the first chunk (when the chunk generator may never start)."""

    def __init__(self, chunks: AsyncIterator[str], streams: list):
        super().__init__(chunks, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.close()


class APIKeyMiddleware:
    """401 for /v1/* requests without `Authorization: Bearer <api key>` (before the body is read)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, enable_rollout_endpoints: bool = False) -> FastAPI:
    """The app; tool_choice "auto" needs enable_auto_tool_choice and a tool_call_parser (see
    serve/tool_parsers.py), reasoning_parser splits off reasoning_content (serve/reasoning_parser.py);
    enable_rollout_endpoints adds /sleep, /update_weights_from_disk, ... (serve/rollout_routes.py)."""
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    metrics = ServerMetrics(llm.stats, served_model_name)
    if enable_rollout_endpoints:
        add_rollout_routes(app, llm)
    created = int(time.time())

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")

    def check_context(prompt_lengths: list[int], max_tokens: int, max_tokens_field: str, prompt_field: str) -> None:
        """Every prompt plus max_tokens within max_model_len, or a 400 that says the context length."""
        limit = llm.config.max_model_len
        longest = max(prompt_lengths)
        if longest >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request "
                                f"has {longest} input tokens. Please reduce the length of the {prompt_field}.",
                           param=prompt_field)
        if longest + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{longest + max_tokens} tokens ({longest} in the {prompt_field}, {max_tokens} in "
                                f"the completion). Please reduce the length of the {prompt_field} or completion.",
                           param=max_tokens_field)

    async def start(request: SamplingFields, prompts: list, max_tokens: int, logprobs: int | None,
                    constraint: Constraint | None = None, prompt_logprobs: int | None = None):
        try:
            params = sampling_params(request, max_tokens, logprobs, constraint.params if constraint else None,
                                     prompt_logprobs)
        except (ValueError, TypeError) as e:
            raise request_field_error(e)
        check_return_token_ids(request)
        check_context([len(p) for p in prompts], max_tokens,
                      "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens",
                      "prompt" if isinstance(request, CompletionRequest) else "messages")
        try:
            return await start_choices(llm, prompts, params, request.priority)
        except (ValueError, TypeError) as e:
            if constraint is not None and str(e).startswith("structured_outputs"):
                raise APIError(400, f"{constraint.field}: {e}", param=constraint.field)    # e.g. a schema xgrammar refuses
            raise request_field_error(e)
        except EngineAsleepError as e:
            raise APIError(503, str(e))
        except EngineDeadError as e:
            raise APIError(500, str(e))
        except EngineClosedError as e:
            raise APIError(503, str(e))

    async def respond(http_request: Request, request: SamplingFields, builder: ResponseBuilder, streams):
        """The whole response, or a stream of chunks; a client that goes away aborts its requests."""
        if request.stream:
            chunks = stream_chunks(builder, streams, request.n, request.include_usage, metrics)
            return ChoicesStreamingResponse(chunks, streams)
        finals = await unless_disconnected(http_request, collect(streams, request.n, metrics))
        prompt_tokens = sum(len(final["prompt_token_ids"]) for final in finals)
        body = builder.response([c for final in finals for c in final["outputs"]], prompt_tokens)
        return JSONResponse(add_token_ids(body, finals, builder.chat) if request.return_token_ids else body)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_alive:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "nanovllm", "root": llm.config.model,
                                            "max_model_len": llm.config.max_model_len}]}

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest) -> dict:
        check_model(request.model)
        return await embedding_response(llm, request, served_model_name)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http_request: Request):
        check_model(request.model)
        try:
            prompts = [llm.tokenizer.encode(p) if isinstance(p, str) else p for p in request.prompts()]
        except ValueError as e:
            raise APIError(400, str(e), param="prompt")
        max_tokens = 16 if request.max_tokens is None else request.max_tokens      # OpenAI's default
        # max_tokens 0 (echo only): one token, dropped (serve/echo.py)
        streams = await start(request, prompts, max(max_tokens, 1), request.logprobs, output_constraint(request),
                              request.engine_prompt_logprobs)
        builder = ResponseBuilder(False, served_model_name, llm.tokenizer, request.logprobs)
        if request.echo or request.prompt_logprobs is not None:     # never streamed (protocol.py)
            finals = await unless_disconnected(http_request, collect(streams, request.n, metrics))
            body = echo_response(builder, request, request.prompts(), finals)
            if request.return_token_ids:
                add_token_ids(body, finals, False, drop_generated=request.max_tokens == 0)
            return JSONResponse(body)
        return await respond(http_request, request, builder, streams)

    async def start_chat(request: ChatCompletionRequest) -> tuple[list, ChatOutputParsing, int]:
        """A chat completion's engine request, how its output is read, and its max_tokens."""
        if request.tool_mode == "auto" and not (enable_auto_tool_choice and tool_call_parser):
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                                "--enable-auto-tool-choice and --tool-call-parser", param="tool_choice")
        constraint = output_constraint(request)
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        try:
            prompt = llm.apply_chat_template([message.for_template() for message in request.messages], tools,
                                             request.chat_template_kwargs)
        except (ValueError, TypeError, TemplateError) as e:
            error = request_field_error(e)
            raise APIError(400, error.message, error.param or "messages")
        max_tokens = request.max_tokens if request.max_completion_tokens is None else request.max_completion_tokens
        if max_tokens is None:                      # as much as the context leaves
            max_tokens = max(1, llm.config.max_model_len - len(prompt))
        streams = await start(request, [prompt], max_tokens, request.num_logprobs, constraint)
        parsing = ChatOutputParsing.for_request(request, constraint is not None, tool_call_parser, reasoning_parser)
        return streams, parsing, max_tokens

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, http_request: Request):
        check_model(request.model)
        streams, parsing, _ = await start_chat(request)
        builder = ResponseBuilder(True, served_model_name, llm.tokenizer, request.num_logprobs, parsing)
        return await respond(http_request, request, builder, streams)

    @app.post("/v1/responses")
    async def responses(request: ResponsesRequest, http_request: Request):
        """OpenAI's Responses API over the chat path (serve/responses_api.py, serve/responses_output.py)."""
        check_model(request.model)
        chat = chat_request(request)
        try:
            streams, parsing, max_tokens = await start_chat(chat)
        except APIError as e:
            raise responses_error(e)
        output = ResponsesOutput(request, served_model_name, parsing.new_choice(), max_tokens, chat.temperature,
                                 chat.top_p)
        if chat.stream:
            return ChoicesStreamingResponse(stream_events(output, streams[0], metrics.observe_finished), streams)
        final, = await unless_disconnected(http_request, collect(streams, 1, metrics))
        out = final["outputs"][0]
        usage = responses_usage(len(final["prompt_token_ids"]), len(out["token_ids"]),
                                final.get("num_cached_tokens") or 0)
        return JSONResponse(output.whole(out["text"], out["finish_reason"], usage))

    @app.post("/tokenize")
    async def tokenize(http_request: Request) -> dict:
        """vLLM's: a prompt, or a conversation under the chat template, as token ids."""
        try:
            body = await http_request.json()
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}")
        kind = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        try:
            request = kind.model_validate(body)
        except ValidationError as e:         # the body type is picked by hand, so its errors are reported here
            first = e.errors()[0]
            loc = [str(part) for part in first["loc"]]
            message = first["msg"].removeprefix("Value error, ")
            named = message.split()[0] if message.split()[0] in kind.model_fields else None
            raise APIError(400, f"{'.'.join(loc)}: {message}" if loc else message, loc[0] if loc else named)
        check_model(request.model)
        if isinstance(request, TokenizeCompletionRequest):
            tokens = llm.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        else:
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
            kwargs = {**(request.chat_template_kwargs or {}), "add_generation_prompt": request.add_generation_prompt,
                      "continue_final_message": request.continue_final_message}
            try:
                tokens = apply_chat_template(llm.tokenizer, [m.for_template() for m in request.messages],
                                             llm.config.model, tools, kwargs, request.add_special_tokens)
            except (ValueError, TypeError, TemplateError) as e:
                error = request_field_error(e)
                raise APIError(400, error.message, error.param or "messages")
        response = {"count": len(tokens), "max_model_len": llm.config.max_model_len, "tokens": tokens}
        if request.return_token_strs:
            response["token_strs"] = llm.tokenizer.convert_ids_to_tokens(tokens)
        return response

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        check_model(request.model)
        vocab_size = len(llm.tokenizer)
        outside = [t for t in request.tokens if not 0 <= t < vocab_size]
        if outside:
            raise APIError(400, f"tokens: ids {outside[:8]} are outside the vocabulary [0, {vocab_size})",
                           param="tokens")
        return {"prompt": llm.tokenizer.decode(request.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def collect(streams, n: int, metrics: ServerMetrics) -> list[dict]:
    """The final output of each prompt's request, in prompt order."""
    finals: list[dict | None] = [None] * len(streams)
    try:
        async for index, out in merge_choices(streams, n, metrics.observe_finished):
            if out["finished"]:
                finals[index // n] = out
    except EngineDeadError as e:
        raise APIError(500, str(e))
    except EngineClosedError as e:
        raise APIError(503, str(e))
    if any(out["finish_reason"] == "abort" for out in finals):
        raise APIError(503, "the request was aborted")
    return finals


async def stream_chunks(builder: ResponseBuilder, streams, n: int, include_usage: bool,
                        metrics: ServerMetrics) -> AsyncIterator[str]:
    """Each choice's new text with its tokens' logprobs, a finish_reason as each choice ends."""
    prompt_tokens = completion_tokens = 0
    try:
        if builder.chat:
            for index in range(len(streams) * n):
                yield sse(builder.role_chunk(index))
        async for index, out in merge_choices(streams, n, metrics.observe_finished):
            if out["finish_reason"] == "abort":
                yield sse(error_body(503, "the request was aborted"))
                break
            logprobs = out["delta_logprobs"] if out["delta_token_ids"] else None
            if out["delta_text"] or out["finish_reason"] or logprobs:
                chunk = builder.delta_chunk(index, out, out["delta_token_ids"], logprobs)
                if chunk is not None:
                    yield sse(chunk)
            if out["finish_reason"]:
                completion_tokens += len(out["token_ids"])
            if out["finished"]:
                prompt_tokens += len(out["prompt_token_ids"])
        else:
            if include_usage:
                yield sse(builder.usage_chunk(prompt_tokens, completion_tokens))
    except (EngineDeadError, EngineClosedError) as e:
        yield sse(error_body(500 if isinstance(e, EngineDeadError) else 503, str(e)))
    yield sse("[DONE]")


async def unless_disconnected(request: Request, work):
    """Run `work` unless the client disconnects first; then cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        gone.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
