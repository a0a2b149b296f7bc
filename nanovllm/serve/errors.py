"""Every error the server answers, as an OpenAI error body: {"error": {message, type, param, code}}."""
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def request_field_error(error: Exception) -> APIError:
    """A ValueError/TypeError from the engine or SamplingParams as a 400; the messages start with
    the argument's name, which is the request field of the same name where there is one."""
    message = str(error).removeprefix("Value error, ")
    return APIError(400, message, _field_named_in(message))


def _field_named_in(message: str) -> str | None:
    from nanovllm.serve.protocol import ChatCompletionRequest, CompletionRequest
    match = re.match(r"\s*([A-Za-z_]+)", message)
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    return match.group(1) if match and match.group(1) in fields else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = loc[0] if loc else None
        message = first.get("msg", "invalid request")
        if param == "prompt":       # a union: pydantic would name the member type it tried last
            return error_response(400, "prompt must be a string, a list of strings, a list of token ids "
                                       "or a list of token-id lists", param)
        if param is None:
            error = request_field_error(ValueError(message))
            return error_response(400, error.message, error.param)
        return error_response(400, f"{'.'.join(loc)}: {message}", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {exc!r}")

