"""The engine requests behind one API request: one per prompt, each with the request's n
completions (SamplingParams.n), started together and read as one stream.

Choice prompt_index * n + completion_index of the response is that completion, as OpenAI numbers
them (prompt-major).
"""
import asyncio
from collections.abc import AsyncIterator, Callable

from nanovllm.async_llm import AsyncLLM, RequestStream
from nanovllm.sampling_params import SamplingParams


async def start_choices(llm: AsyncLLM, prompts: list, params: SamplingParams, priority: int = 0) -> list[RequestStream]:
    """Add every prompt's request at once; if any is refused, abort the others and raise its error."""
    started = await asyncio.gather(*(llm.add_request(prompt, params, priority=priority) for prompt in prompts),
                                   return_exceptions=True)
    streams = [s for s in started if isinstance(s, RequestStream)]
    errors = [e for e in started if isinstance(e, BaseException)]
    if errors:
        for stream in streams:
            stream.close()
        raise errors[0]
    return streams


def report_end(out: dict, on_finished: Callable[[dict], None]) -> None:
    """Tell on_finished about a request that ended other than by abort."""
    if out["finished"] and out["finish_reason"] != "abort":
        on_finished(out)


async def merge_choices(streams: list[RequestStream], n: int,
                        on_finished: Callable[[dict], None]) -> AsyncIterator[tuple[int, dict]]:
    """(choice index, output) in arrival order over all prompts' requests. Leaving early, or an
    error in one request, aborts every request still running."""
    if len(streams) == 1:               # the common case, read directly: no task and queue per output
        with streams[0] as stream:
            async for out in stream:
                report_end(out, on_finished)
                yield out["index"], out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(prompt_index: int, stream: RequestStream) -> None:
        try:
            with stream:
                async for out in stream:
                    report_end(out, on_finished)
                    merged.put_nowait((prompt_index * n + out["index"], out))
        except Exception as e:
            merged.put_nowait((prompt_index, e))
        merged.put_nowait((prompt_index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:          # also before a pump task first ran
            stream.close()
