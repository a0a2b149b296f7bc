"""POST /v1/embeddings, OpenAI's body and response, on a `--runner pooling` server.

Each input (a string, a list of strings, a list of token ids or a list of such lists) is one pooling
request; its embedding is the last token's final hidden state, L2-normalised (docs/embeddings.md),
sent as floats or, with `encoding_format: "base64"` (the openai client's default), as the base64
of little-endian float32 values.
"""
import asyncio
import base64
import re
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from nanovllm.async_llm import AsyncLLM, EngineClosedError, EngineDeadError
from nanovllm.pooling_params import PoolingParams
from nanovllm.serve.errors import APIError

TokenIds = list[StrictInt]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
    return embedding


def _engine_error(error: Exception) -> APIError:
    """An engine ValueError as a 400 naming the field: `dimensions`, or `input` for a bad prompt."""
    message = str(error)
    word = re.match(r"\s*([A-Za-z_]+)", message)
    param = {"dimensions": "dimensions", "prompt": "input"}.get(word.group(1) if word else "")
    return APIError(400, message, param)


async def _embed_one(llm: AsyncLLM, prompt: str | list[int], params: PoolingParams) -> dict:
    final = None
    async for out in llm.generate(prompt, params):
        final = out
    return final


async def embedding_response(llm: AsyncLLM, request: EmbeddingRequest, served_model_name: str) -> dict:
    if llm.config.runner != "pooling":
        raise APIError(400, "this server generates text (runner='generate'); /v1/embeddings needs a server "
                            "started with `nanovllm serve MODEL --runner pooling`", code="model_not_supported")
    prompts = request.prompts()
    if not prompts:
        raise APIError(400, "input must not be empty", param="input")
    params = PoolingParams(request.dimensions)
    try:
        params.validate(llm.config.model_config.hidden_size)
        token_ids = [llm.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        finals = await asyncio.gather(*[_embed_one(llm, ids, params) for ids in token_ids])
    except (ValueError, TypeError) as e:
        raise _engine_error(e)
    except EngineDeadError as e:
        raise APIError(500, str(e))
    except EngineClosedError as e:
        raise APIError(503, str(e))
    if any(final is None or final.get("finish_reason") == "abort" for final in finals):
        raise APIError(503, "the request was aborted")
    num_tokens = sum(len(ids) for ids in token_ids)
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": encode_embedding(final["embedding"],
                                                                                   request.encoding_format)}
                     for i, final in enumerate(finals)],
            "model": served_model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
