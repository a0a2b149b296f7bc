"""Rollout control over HTTP (docs/rollout.md), only with `--enable-rollout-endpoints` (they change
the model): vLLM's names and parameters (`/sleep?level=`, `/wake_up?tags=`, ...), each also taking
its parameters as a JSON body. Every bad parameter is a 400 naming it."""
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nanovllm.async_llm import AsyncLLM, EngineClosedError, EngineDeadError
from nanovllm.serve.errors import APIError


async def _params(request: Request) -> dict:
    """The query parameters, then the JSON body's fields over them (a repeated query key: a list)."""
    params = {}
    for key in request.query_params:
        values = request.query_params.getlist(key)
        params[key] = values if len(values) > 1 else values[0]
    body = await request.body()
    if body.strip():
        try:
            fields = json.loads(body)
        except ValueError as e:
            raise APIError(400, f"the request body is not valid JSON: {e}")
        if not isinstance(fields, dict):
            raise APIError(400, "the request body must be a JSON object")
        params.update(fields)
    return params


def _int(params: dict, name: str, default: int | None) -> int | None:
    value = params.get(name, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise APIError(400, f"{name} must be an integer, got {value!r}", param=name)


async def _engine(call, param: str | None = None):
    """Await an AsyncLLM rollout call; its errors as OpenAI error bodies."""
    try:
        return await call
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=param)
    except EngineDeadError as e:
        raise APIError(500, str(e))
    except EngineClosedError as e:
        raise APIError(503, str(e))
    except RuntimeError as e:          # e.g. sleep with requests running, an update while asleep
        raise APIError(409, str(e))


def add_rollout_routes(app: FastAPI, llm: AsyncLLM) -> None:
    @app.post("/sleep")
    async def sleep(request: Request) -> JSONResponse:
        level = _int(await _params(request), "level", 1)
        await _engine(llm.sleep(level), "level")
        return JSONResponse({"is_sleeping": True, "level": level})

    @app.post("/wake_up")
    async def wake_up(request: Request) -> JSONResponse:
        tags = (await _params(request)).get("tags")
        if not (tags is None or isinstance(tags, str) or
                (isinstance(tags, list) and all(isinstance(t, str) for t in tags))):
            raise APIError(400, f"tags must be a list of strings, got {tags!r}", param="tags")
        await _engine(llm.wake_up(tags), "tags")
        return JSONResponse({"is_sleeping": await _engine(llm.is_sleeping())})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await _engine(llm.is_sleeping())})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return JSONResponse({"success": await _engine(llm.reset_prefix_cache())})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        params = await _params(request)
        path = params.get("model_path")
        if not isinstance(path, str) or not path:
            raise APIError(400, f"model_path must be a checkpoint directory, got {path!r}", param="model_path")
        version = _int(params, "weight_version", None)
        version = await _engine(llm.update_weights_from_disk(path, version), "model_path")
        return JSONResponse({"success": True, "message": f"weights loaded from {path}", "weight_version": version})

    @app.post("/pause")
    async def pause() -> JSONResponse:
        await _engine(llm.pause_generation())
        return JSONResponse({"paused": True})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        await _engine(llm.resume_generation())
        return JSONResponse({"paused": False})

    @app.get("/weight_version")
    async def weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": await _engine(llm.weight_version())})
