"""AsyncLLM: one engine serving many asyncio callers.

The engine is not thread-safe, so one background thread owns it from construction to shutdown:
it runs the step loop and applies the adds and aborts that callers hand it through a queue. Each
request's outputs go back to its caller's event loop through an asyncio queue, one
`call_soon_threadsafe` per event loop per step. With no work, the thread blocks on its queue.

The engine thread and the callers' event loops share one interpreter lock, so every output (a
server writes each as a chunk) delays the next step. With more than STREAMS_PER_STEP live
requests, a request hears from the engine every few steps instead of every step, with all its new
tokens (its first output and its endings are never held back): about STREAMS_PER_STEP outputs per
step however many requests run, and the engine detokenizes only for those.

    llm = AsyncLLM(path)
    async for out in llm.generate("introduce yourself", SamplingParams(max_tokens=64)):
        print(out["delta_text"], end="")

Leaving the loop early aborts the request when the generator is closed: at once under
`contextlib.aclosing(llm.generate(...))`, otherwise when Python finalizes it (soon after the loop).
"""
import asyncio
import logging
import queue
import threading
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]
logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; the AsyncLLM cannot serve anymore (the cause is chained)."""


class EngineClosedError(RuntimeError):
    """The AsyncLLM was shut down while the request was waiting or running."""


@dataclass(eq=False)
class _Delivery:
    """Where one request's outputs go: an asyncio queue read on the caller's event loop."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last: dict | None = None           # the last output sent, to end an aborted stream with
    sent_at_step: int = 0              # the engine step it last heard from


@dataclass
class _Add:
    request_id: Hashable
    prompt: Prompt
    sampling_params: SamplingParams | None
    delivery: _Delivery


@dataclass
class _Abort:
    request_id: Hashable
    done: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None   # set to "was it live"


STREAMS_PER_STEP = 32
_END_ALL = object()      # abort every live request; after shutdown() also stop the thread
_ACCEPTED = object()    # first item of a delivery queue: the engine took the request


class RequestStream:
    """The outputs of one request as they arrive. Outputs that queued up while the reader was busy
    come joined, one per completion index (their deltas joined, never across indices), so a slow
    reader costs fewer, larger messages rather than a growing backlog. Closing the stream (or
    leaving a `with` block) before the last output aborts the request."""

    def __init__(self, llm: "AsyncLLM", request_id: Hashable, delivery: _Delivery):
        self.request_id = request_id
        self.finished = False              # the last output has arrived (or an error)
        self._llm = llm
        self._queue = delivery.queue
        self._ready: deque[dict] = deque()               # arrived and joined, not yet handed out
        self._held_error: BaseException | None = None   # arrived behind outputs already joined

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> dict:
        if not self._ready:
            if self.finished:
                raise StopAsyncIteration
            await self._take_arrived()
        return self._ready.popleft()

    async def _take_arrived(self) -> None:
        """Wait for one output, take every one queued behind it, and join them per index; the
        index that moved last goes last, so the request's final output stays the last one."""
        item = self._held_error or await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        joined: dict[int, dict] = {}
        while True:
            before = joined.pop(item["index"], None)
            joined[item["index"]] = item if before is None else _joined(before, item)
            if item["finished"] or self._queue.empty():
                break
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._held_error = item
                break
        self.finished = any(out["finished"] for out in joined.values())
        self._ready.extend(joined.values())

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._llm._commands.put(_Abort(self.request_id))

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncLLM:
    def __init__(self, model: str, **engine_args):
        self.engine = None                      # the LLM, owned by the engine thread
        self._commands: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._closed = False
        self._stats: dict = {}
        self._live: dict[Hashable, _Delivery] = {}   # engine thread only
        self._num_steps = 0                            # engine thread only
        self._due_interval = 1                         # engine thread only: steps between a request's outputs
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model, engine_args, ready),
                                        name="nanovllm-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if self.engine is None:                 # construction failed: bad arguments, no model, ...
            self._thread.join()
            raise self._error

    # ---- caller side (any event loop) ----------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of one conversation with the generation prompt (reads only the tokenizer)."""
        return self.engine.apply_chat_template(messages)

    def stats(self) -> dict:
        """The engine's counters and gauges as of its last step (see LLMEngine.stats)."""
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._error is None and not self._closed

    async def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                          request_id: Hashable | None = None) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Bad input raises here (ValueError
        or TypeError naming the argument), as does a duplicate live request_id."""
        self._check_usable()
        request_id = uuid.uuid4().hex if request_id is None else request_id
        delivery = _Delivery(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, prompt, sampling_params, delivery))
        try:
            first = await delivery.queue.get()
        except asyncio.CancelledError:
            self._commands.put(_Abort(request_id))
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, request_id, delivery)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: Hashable | None = None) -> AsyncIterator[dict]:
        """Yield the request's progress as tokens arrive: `delta_text`, `delta_token_ids`, the
        cumulative `text` and `token_ids`, `finished`, `finish_reason`; `delta_logprobs` (the new
        tokens' logprobs, when asked for, else None); the last one also carries the fields of the
        engine's final output (`outputs`, `metrics`, ..., and this completion's `logprobs`).

        Each output is the progress of one completion, numbered by `index` (0..n-1; always 0 when
        n is 1): the text and token fields are that completion's, `finish_reason` is set on the
        output that ends it, and `finished` only on the last output of the request, once all n
        completions ended. Leaving the loop early aborts the request (all n completions)."""
        stream = await self.add_request(prompt, sampling_params, request_id)
        with stream:
            async for out in stream:
                yield out

    async def abort(self, request_id: Hashable) -> bool:
        """Abort a request and free its KV blocks; True if it was still live. Its stream ends with
        an output whose finish_reason is "abort"."""
        self._check_usable()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(_Abort(request_id, (loop, done)))
        return await done

    def abort_all(self) -> None:
        """Abort every live request (their streams end with an EngineClosedError); thread-safe."""
        self._commands.put(_END_ALL)

    def shutdown(self) -> None:
        """Abort every live request, stop the engine (and its workers) and the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(_END_ALL)
        self._thread.join()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineClosedError("this AsyncLLM has been shut down")
        if self._error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self._error!r}") from self._error

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self, model: str, engine_args: dict, ready: threading.Event) -> None:
        from nanovllm.llm import LLM
        try:
            self.engine = LLM(model, **engine_args)
        except BaseException as e:
            self._error = e
            return
        finally:
            ready.set()
        try:
            self._stats = self.engine.stats()
            self._serve()
        except BaseException as e:             # a failing step, a dead worker: tell every caller
            logger.exception("nanovllm: the engine thread failed; every request now gets an error")
            self._error = e
            dead = EngineDeadError(f"the engine failed: {e!r}")
            dead.__cause__ = e
            self._deliver([(d, dead) for d in self._live.values()])
            self._live.clear()
            self._refuse_until_stop(dead)
        finally:
            self.engine.shutdown()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            for command in self._drain(block=engine.is_finished()):
                if command is _END_ALL:
                    self._end_all(EngineClosedError("the engine is shutting down"))
                    if self._closed:
                        return
                else:
                    self._apply(command)
            if not engine.is_finished():
                self._num_steps += 1
                self._due_interval = -(-len(self._live) // STREAMS_PER_STEP)
                self._dispatch(engine.step_updates(self._due))
            self._stats = engine.stats()

    def _drain(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.prompt, command.sampling_params, command.request_id)
            except Exception as e:              # bad input: only this caller hears of it
                self._deliver([(command.delivery, e)])
                return
            self._live[command.request_id] = command.delivery
            self._deliver([(command.delivery, _ACCEPTED)])
            return
        was_live = self.engine.abort(command.request_id)
        delivery = self._live.pop(command.request_id, None)
        if delivery is not None:
            last = delivery.last or {"index": 0, "text": "", "token_ids": []}
            self._deliver([(delivery, {"request_id": command.request_id, "index": last["index"], "delta_text": "",
                                       "delta_token_ids": [], "delta_logprobs": None, "text": last["text"],
                                       "token_ids": last["token_ids"], "finished": True,
                                       "finish_reason": "abort"})])
        if command.done is not None:
            loop, future = command.done
            loop.call_soon_threadsafe(_set_result, future, was_live)

    def _due(self, request_id: Hashable) -> bool:
        """Does this request hear from this step (see the top of this file)?"""
        delivery = self._live.get(request_id)
        return (delivery is None or delivery.last is None
                or self._num_steps - delivery.sent_at_step >= self._due_interval)

    def _dispatch(self, updates: list) -> None:
        items = []
        for update in updates:
            delivery = self._live.get(update.request_id)
            if delivery is None:
                continue
            finished = update.output is not None         # the engine's output ends the request
            out = dict(update.output) if finished else {}
            out.update(request_id=update.request_id, index=update.index, delta_text=update.delta_text,
                       delta_token_ids=update.new_token_ids, delta_logprobs=update.new_logprobs,
                       text=update.text, token_ids=update.token_ids, finished=finished,
                       finish_reason=update.finish_reason)
            if finished:          # the top-level fields are those of this output's completion
                out["logprobs"] = update.output["outputs"][update.index]["logprobs"]
                del self._live[update.request_id]
            delivery.last, delivery.sent_at_step = out, self._num_steps
            items.append((delivery, out))
        self._deliver(items)

    def _end_all(self, error: BaseException) -> None:
        for request_id in list(self._live):
            self.engine.abort(request_id)
        self._deliver([(d, error) for d in self._live.values()])
        self._live.clear()

    def _refuse_until_stop(self, error: BaseException) -> None:
        """After a failure, answer every add with the error until shutdown, so nobody waits forever."""
        while True:
            command = self._commands.get()
            if command is _END_ALL:
                if self._closed:
                    return
            elif isinstance(command, _Add):
                self._deliver([(command.delivery, error)])
            elif command.done is not None:
                command.done[0].call_soon_threadsafe(_set_result, command.done[1], False)

    @staticmethod
    def _deliver(items: list[tuple[_Delivery, object]]) -> None:
        """Hand items to their event loops: one wake-up per loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for delivery, item in items:
            by_loop[delivery.loop].append((delivery.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:                # that caller's event loop is closed: nobody listens
                pass


def _joined(before: dict, after: dict) -> dict:
    """Two outputs of one completion as one: the later one with both deltas."""
    logprobs = None if after["delta_logprobs"] is None else before["delta_logprobs"] + after["delta_logprobs"]
    return {**after, "delta_text": before["delta_text"] + after["delta_text"],
            "delta_token_ids": before["delta_token_ids"] + after["delta_token_ids"], "delta_logprobs": logprobs}


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)
