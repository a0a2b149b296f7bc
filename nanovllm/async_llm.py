"""AsyncLLM: one engine serving many asyncio callers.

The engine runs in its own process (`engine_process=True`, the default): an EngineLoop (see
engine_loop.py) steps it there, and this process only tokenizes chat templates, routes outputs and
serves its callers, so neither side waits for the other's interpreter lock. Commands go to the
engine through a queue (a small thread moves them onto a pipe); the engine answers with one message
per loop iteration, which a reader thread routes to each request's asyncio queue, one
`call_soon_threadsafe` per event loop per message.

`engine_process=False` runs the same loop on a thread of this process instead: `llm.engine` is
then reachable (tests inject failures through it), at the price of one interpreter lock shared by
the engine and the callers, which slows a loaded server down (each output written delays the next
step). Use it when a second process is not wanted (debugging, a notebook on a small model).

    llm = AsyncLLM(path)
    async for out in llm.generate("introduce yourself", SamplingParams(max_tokens=64)):
        print(out["delta_text"], end="")

Leaving the loop early aborts the request when the generator is closed: at once under
`contextlib.aclosing(llm.generate(...))`, otherwise when Python finalizes it (soon after the loop).
A script that starts the engine process needs the `if __name__ == "__main__":` guard (spawn).
"""
import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import pickle
import queue
import threading
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from nanovllm.engine.chat_template import apply_chat_template
from nanovllm.async_rollout import AsyncRollout
from nanovllm.engine_loop import (ABORTED, ACCEPTED, CALLED, CLOSED, FAILED, OUTPUT, REFUSED, AbortAll, AbortRequest,
                                  AddRequest, Command, EngineCall, EngineLoop, Message, Stop, queue_receiver,
                                  run_engine_process)
from nanovllm.sampling_params import SamplingParams

Prompt = str | list[int]
logger = logging.getLogger(__name__)
STOP_TIMEOUT = 20.0       # seconds the engine process gets to stop before it is terminated


class EngineDeadError(RuntimeError):
    """The engine failed or its process died; the AsyncLLM cannot serve anymore (the cause is chained)."""


class EngineClosedError(RuntimeError):
    """The AsyncLLM was shut down while the request was waiting or running."""


@dataclass(eq=False, slots=True)
class _Delivery:
    """Where one request's outputs go: an asyncio queue read on the caller's event loop. Outputs
    arrive with deltas only; the cumulative text and token ids of each completion are kept here."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)

    def add_cumulative_fields(self, out: dict) -> None:
        index = out["index"]
        out["text"] = self.texts[index] = self.texts.get(index, "") + out["delta_text"]
        out["token_ids"] = self.token_ids[index] = self.token_ids.get(index, []) + out["delta_token_ids"]


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
            self._llm._commands.put(AbortRequest(self.request_id))

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncLLM(AsyncRollout):
    def __init__(self, model: str, engine_process: bool = True, **engine_args):
        """Start the engine (in its own process unless engine_process=False) and wait until it is
        ready; bad engine arguments raise here (TypeError, or ValueError naming the argument)."""
        if not isinstance(engine_process, bool):
            raise TypeError(f"engine_process must be a bool, got {engine_process!r}")
        self.engine = None                      # the LLMEngine, only with engine_process=False
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()   # put() is safe from finalizers
        self._lock = threading.Lock()           # guards the two dicts below, _error and _closed
        self._deliveries: dict[Hashable, _Delivery] = {}
        self._abort_replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}   # EngineCall's
        self._reply_tokens = itertools.count()
        self._error: BaseException | None = None
        self._closed = False
        self._stats: dict = {}
        self._process: mp.Process | None = None
        self._threads: list[threading.Thread] = []
        if engine_process:
            self._start_process(model, engine_args)
        else:
            self._start_thread(model, engine_args)
        atexit.register(self.shutdown)    # after multiprocessing's own (LIFO): stop the engine before it joins

    def _start_thread(self, model: str, engine_args: dict) -> None:
        """The EngineLoop on a thread of this process; it builds the engine and owns it."""
        started: queue.SimpleQueue = queue.SimpleQueue()

        def serve() -> None:
            from nanovllm.engine.llm_engine import LLMEngine
            try:
                engine = LLMEngine(model, **engine_args)
            except BaseException as e:
                started.put(e)
                return
            started.put(engine)
            try:
                EngineLoop(engine, queue_receiver(self._commands), self._route).run()
            finally:
                engine.shutdown()

        thread = threading.Thread(target=serve, name="nanovllm-engine", daemon=True)
        thread.start()
        engine = started.get()
        if isinstance(engine, BaseException):      # construction failed: bad arguments, no model, ...
            thread.join()
            raise engine
        self.engine, self._threads = engine, [thread]
        self.config, self.tokenizer, self._stats = engine.config, engine.tokenizer, engine.stats()

    def _start_process(self, model: str, engine_args: dict) -> None:
        """The EngineLoop in a spawned process (not a daemon: tensor-parallel workers start from it)."""
        context = mp.get_context("spawn")
        commands_read, commands_write = context.Pipe(duplex=False)
        messages_read, messages_write = context.Pipe(duplex=False)
        process = context.Process(target=run_engine_process, name="nanovllm-engine",
                                  args=(model, engine_args, commands_read, messages_write))
        try:
            process.start()
            commands_read.close()
            messages_write.close()
            try:
                ready = messages_read.recv()
            except EOFError:
                process.join()
                raise RuntimeError(f"the engine process exited with code {process.exitcode} before it was ready") \
                    from None
            if ready[0] == FAILED:
                process.join()
                raise ready[1]
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(ready[1].model)
        except BaseException:                   # also Ctrl-C while the engine loads: leave no process behind
            for conn in (commands_write, messages_read):
                conn.close()
            if process.is_alive():
                process.kill()
            if process.pid is not None:
                process.join()
            raise
        _, self.config, self._stats = ready
        self._process = process
        self._threads = [threading.Thread(target=self._forward_commands, args=(commands_write,),
                                          name="nanovllm-engine-commands", daemon=True),
                         threading.Thread(target=self._read_messages, args=(messages_read,),
                                          name="nanovllm-engine-messages", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ---- caller side (any event loop) ----------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of one conversation with the generation prompt (reads only the tokenizer)."""
        return apply_chat_template(self.tokenizer, messages, self.config.model, tools, chat_template_kwargs)

    def stats(self) -> dict:
        """The engine's counters and gauges as of its last message (see LLMEngine.stats)."""
        return self._stats

    @property
    def is_alive(self) -> bool:
        return self._error is None and not self._closed

    async def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                          request_id: Hashable | None = None, priority: int = 0) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Bad input raises here (ValueError
        or TypeError naming the argument), as does a duplicate live request_id. `priority`: lower
        first, under scheduling_policy="priority"."""
        request_id = uuid.uuid4().hex if request_id is None else request_id
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request_id must be hashable, got {request_id!r}") from None
        delivery = _Delivery(asyncio.get_running_loop())
        with self._lock:
            self._check_usable()
            if request_id in self._deliveries:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._deliveries[request_id] = delivery
        self._commands.put(AddRequest(request_id, prompt, sampling_params, priority))
        try:
            first = await delivery.queue.get()
        except asyncio.CancelledError:
            self._commands.put(AbortRequest(request_id))
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, request_id, delivery)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: Hashable | None = None, priority: int = 0) -> AsyncIterator[dict]:
        """Yield the request's progress as tokens arrive: `delta_text`, `delta_token_ids`, the
        cumulative `text` and `token_ids`, `finished`, `finish_reason`; `delta_logprobs` (the new
        tokens' logprobs, when asked for, else None); the last one also carries the fields of the
        engine's final output (`outputs`, `metrics`, ..., and this completion's `logprobs`).

        Each output is the progress of one completion, numbered by `index` (0..n-1; always 0 when
        n is 1): the text and token fields are that completion's, `finish_reason` is set on the
        output that ends it, and `finished` only on the last output of the request, once all n
        completions ended. Leaving the loop early aborts the request (all n completions)."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority)
        with stream:
            async for out in stream:
                yield out

    async def abort(self, request_id: Hashable) -> bool:
        """Abort a request and free its KV blocks; True if it was still live. Its stream ends with
        an output whose finish_reason is "abort"."""
        return await self._ask_engine(self._abort_replies, lambda token: AbortRequest(request_id, token))

    async def _ask_engine(self, replies: dict, command) -> object:
        """Put command(token) to the engine loop, which answers under that token in `replies`; the answer."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._lock:
            self._check_usable()
            token = next(self._reply_tokens)
            replies[token] = (loop, done)
        self._commands.put(command(token))
        return await done

    def abort_all(self) -> None:
        """Abort every live request (their streams end with an EngineClosedError); thread-safe."""
        self._commands.put(AbortAll())

    def shutdown(self) -> None:
        """Abort every live request, stop the engine (its process, its workers) and the threads
        that serve it. Idempotent; also run at interpreter exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        self._commands.put(Stop())
        if self._process is not None:
            self._process.join(STOP_TIMEOUT)
            if self._process.is_alive():
                logger.warning("nanovllm: the engine process did not stop in %.0f s; terminating it", STOP_TIMEOUT)
                self._process.terminate()
                self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        for thread in self._threads:
            thread.join()
        with self._lock:                        # requests the engine never answered
            ended = self._end_everything(EngineClosedError("the engine is shutting down"))
        _deliver(ended)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineClosedError("this AsyncLLM has been shut down")
        if self._error is not None:
            raise EngineDeadError(f"the engine failed earlier: {self._error!r}") from self._error

    # ---- outputs: on the engine thread, or the reader thread of the engine process's messages ----

    def _route(self, message: Message) -> None:
        """Hand every item of one engine message to the caller it is for."""
        items, self._stats = message
        routed: list[tuple[_Delivery, object]] = []
        with self._lock:
            for item in items:
                kind = item[0]
                if kind == OUTPUT:
                    delivery = self._deliveries.get(item[1])
                    if delivery is not None:
                        delivery.add_cumulative_fields(item[2])
                        routed.append((delivery, item[2]))
                        if item[2]["finished"]:
                            del self._deliveries[item[1]]
                elif kind == ACCEPTED:
                    if item[1] in self._deliveries:
                        routed.append((self._deliveries[item[1]], _ACCEPTED))
                elif kind in (REFUSED, CLOSED):
                    delivery = self._deliveries.pop(item[1], None)
                    if delivery is not None:
                        error = item[2] if kind == REFUSED else EngineClosedError("the engine is shutting down")
                        routed.append((delivery, error))
                elif kind == ABORTED:
                    if item[1] in self._abort_replies:
                        _answer(self._abort_replies.pop(item[1]), item[2])
                elif kind == CALLED:
                    if item[1] in self._call_replies:
                        _answer(self._call_replies.pop(item[1]), item[3] if item[2] else _Raise(item[3]))
                elif kind == FAILED:
                    routed += self._engine_died(item[1])
        _deliver(routed)

    def _engine_died(self, cause: BaseException) -> list[tuple[_Delivery, object]]:
        """Under the lock: from now on every caller hears EngineDeadError (the cause chained)."""
        if self._error is not None:
            return []
        self._error = cause
        dead = EngineDeadError(f"the engine failed: {cause!r}")
        dead.__cause__ = cause
        return self._end_everything(dead)

    def _end_everything(self, error: BaseException) -> list[tuple[_Delivery, object]]:
        """Under the lock: end every request this side knows of with error; abort() answers False."""
        ended = [(delivery, error) for delivery in self._deliveries.values()]
        self._deliveries.clear()
        for waiter in self._abort_replies.values():
            _answer(waiter, False)
        self._abort_replies.clear()
        for waiter in self._call_replies.values():
            _answer(waiter, _Raise(error))
        self._call_replies.clear()
        return ended

    def _read_messages(self, conn: Connection) -> None:
        """Route the engine process's messages until its pipe ends; if it ends before shutdown,
        the process died (killed, crashed) and every caller hears of it."""
        try:
            while True:
                self._route(conn.recv())
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
        if self._closed:                    # shutdown() stopped it, and ends what is left
            return
        self._process.join(1)     # its exit code, for the error (a blocking wait: fds close before the status is set)
        cause = RuntimeError(f"the engine process died (exit code {self._process.exitcode})")
        with self._lock:
            ended = [] if self._closed else self._engine_died(cause)
        _deliver(ended)

    def _forward_commands(self, conn: Connection) -> None:
        """Move commands from the queue onto the engine process's pipe, in batches, until Stop."""
        receive = queue_receiver(self._commands)
        try:
            while True:
                commands = receive(True)
                self._send_commands(conn, commands)
                if any(isinstance(command, Stop) for command in commands):
                    return
        except OSError:                     # the process is gone; the reader tells the callers
            pass
        finally:
            conn.close()

    def _send_commands(self, conn: Connection, commands: list[Command]) -> None:
        try:
            conn.send(commands)
            return
        except (pickle.PicklingError, TypeError, AttributeError):
            pass                            # a request_id, prompt or sampling_params that does not pickle
        for command in commands:
            try:
                conn.send([command])
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                error = TypeError(f"request_id, prompt and sampling_params must pickle to reach the engine "
                                  f"process: {e}")
                if isinstance(command, AddRequest):
                    self._route(([(REFUSED, command.request_id, error)], self._stats))
                elif isinstance(command, AbortRequest) and command.reply_token is not None:
                    self._route(([(ABORTED, command.reply_token, False)], self._stats))
                elif isinstance(command, EngineCall):
                    self._route(([(CALLED, command.reply_token, False, TypeError(
                        f"the arguments of {command.method} must pickle to reach the engine process: {e}"))],
                        self._stats))


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


def _answer(waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future], was_live: bool) -> None:
    loop, future = waiter
    try:
        loop.call_soon_threadsafe(_set_result, future, was_live)
    except RuntimeError:                    # that caller's event loop is closed
        pass


def _joined(before: dict, after: dict) -> dict:
    """Two outputs of one completion as one: the later one with both deltas."""
    logprobs = None if after["delta_logprobs"] is None else before["delta_logprobs"] + after["delta_logprobs"]
    return {**after, "delta_text": before["delta_text"] + after["delta_text"],
            "delta_token_ids": before["delta_token_ids"] + after["delta_token_ids"], "delta_logprobs": logprobs}


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


@dataclass(slots=True)
class _Raise:
    """An answer that is an error: the waiting caller raises it."""
    error: BaseException


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        if isinstance(value, _Raise):
            future.set_exception(value.error)
        else:
            future.set_result(value)
