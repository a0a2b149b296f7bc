"""The engine requests behind one API request: started together, read as one stream.

Choice i of the response is the i-th engine request (prompt-major, then the n choices of each
prompt), as OpenAI numbers them.
"""
import asyncio
from collections.abc import AsyncIterator, Callable

from nanovllm.async_llm import AsyncLLM, RequestStream
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.sampling import params_per_choice


async def start_choices(llm: AsyncLLM, prompts: list, params: SamplingParams, n: int) -> list[RequestStream]:
    """Add every choice's request at once; if any is refused, abort the others and raise its error."""
    requests = [llm.add_request(prompt, choice_params) for prompt in prompts
                for choice_params in params_per_choice(params, n)]
    started = await asyncio.gather(*requests, return_exceptions=True)
    streams = [s for s in started if isinstance(s, RequestStream)]
    errors = [e for e in started if isinstance(e, BaseException)]
    if errors:
        for stream in streams:
            stream.close()
        raise errors[0]
    return streams


async def merge_choices(streams: list[RequestStream],
                        on_finished: Callable[[dict], None]) -> AsyncIterator[tuple[int, dict]]:
    """(choice index, output) in arrival order over all choices. Leaving early, or an error in
    one choice, aborts every choice still running."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            with stream:
                async for out in stream:
                    if out["finished"] and out["finish_reason"] != "abort":
                        on_finished(out)
                    merged.put_nowait((index, out))
        except Exception as e:
            merged.put_nowait((index, e))
        merged.put_nowait((index, None))

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
