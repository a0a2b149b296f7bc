"""EngineLoop: the engine side of AsyncLLM. It owns one LLMEngine, applies the commands it receives
(add, abort, abort all, stop) and steps the engine while there is work; with none, it blocks on its
inbox. It knows requests only by id: every loop iteration that produced anything sends one message,
`(items, stats)`, with every item of that iteration and the engine's latest stats. The same loop
runs in the engine process (messages over a pipe) or on a thread (messages handed over directly).

Items, as tuples (kind first):
    (ACCEPTED, request_id)                  the engine took the request
    (REFUSED, request_id, error)            bad input: only this request fails
    (OUTPUT, request_id, out)               progress; out["finished"] ends the request
    (CLOSED, request_id)                    ended by abort-all or stop
    (ABORTED, reply_token, was_live)        the answer to an AbortRequest with a reply_token
    (FAILED, error)                         the engine failed: every request is lost
    (CALLED, reply_token, ok, value)        the answer to an EngineCall: its result (ok) or its error

An EngineCall runs a rollout method of the engine between steps (engine/rollout.py: update_weights,
sleep, ...), or pauses / resumes the loop: while paused it runs no step (the requests keep their
state; new ones queue) and still applies every command.

An output carries deltas only (`delta_text`, `delta_token_ids`, ...), not the cumulative `text`
and `token_ids`: those grow with the completion, and the receiving side rebuilds them, so the
engine does not pickle them at every step. `run_engine_process` is the engine process's main.

With more than STREAMS_PER_STEP live requests, a request hears from the engine every few steps
instead of every step, with all its new tokens (its first output and its endings are never held
back): about STREAMS_PER_STEP outputs per step however many requests run, and the engine
detokenizes only for those.
"""
import logging
import pickle
import queue
import signal
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from nanovllm.engine.output_processor import aborted_stream_dict
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STREAMS_PER_STEP = 32
ACCEPTED, REFUSED, OUTPUT, CLOSED, ABORTED, FAILED = "accepted", "refused", "output", "closed", "aborted", "failed"
CALLED = "called"
ENGINE_CALLS = frozenset({"update_weights", "update_weights_from_disk", "init_weight_update_group",
                          "update_weights_from_distributed", "sleep", "wake_up", "is_sleeping",
                          "reset_prefix_cache", "weight_version", "pause_generation", "resume_generation",
                          "is_paused"})
READY = "ready"                                  # the engine process's first message

Prompt = str | list[int]
Message = tuple[list[tuple], dict]              # (items, engine stats)


@dataclass(slots=True)
class AddRequest:
    request_id: Hashable
    prompt: Prompt
    sampling_params: SamplingParams | None
    priority: int = 0


@dataclass(slots=True)
class AbortRequest:
    request_id: Hashable
    reply_token: int | None = None               # answer with (ABORTED, reply_token, was_live)


@dataclass(slots=True)
class AbortAll:
    """End every live request with CLOSED."""


@dataclass(slots=True)
class Stop:
    """AbortAll, then leave the loop."""


@dataclass(slots=True)
class EngineCall:
    """Run one of ENGINE_CALLS between steps; answered with (CALLED, reply_token, ok, value)."""
    method: str
    args: tuple
    kwargs: dict
    reply_token: int


Command = AddRequest | AbortRequest | AbortAll | Stop | EngineCall


@dataclass(slots=True)
class _RequestState:
    last_index: int | None = None     # the completion its last output was about (None: nothing sent)
    sent_at_step: int = 0             # the engine step it last heard from


class EngineLoop:
    def __init__(self, engine, receive: Callable[[bool], list[Command]], send: Callable[[Message], None]):
        """`receive(block)` returns the commands that arrived (waiting for one if block), `send`
        hands one message to the frontend."""
        self.engine = engine
        self.receive = receive
        self.send = send
        self._live: dict[Hashable, _RequestState] = {}
        self._items: list[tuple] = []                  # of this iteration
        self._stats: dict = engine.stats()             # as of the last message
        self._num_steps = 0
        self._due_interval = 1                         # steps between a request's outputs
        self._paused = False                           # pause_generation(): no step until resume

    def run(self) -> None:
        """Serve until Stop. An engine failure is sent as FAILED; then every add is refused until Stop."""
        try:
            self._serve()
        except BaseException as e:             # a failing step, a dead worker: tell every caller
            logger.exception("nanovllm: the engine failed; every request now gets an error")
            error = portable_exception(e)
            self._live.clear()
            self._items.append((FAILED, error))
            self._flush(self._stats)          # the engine may not answer anymore
            self._refuse_until_stop(error)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            for command in self.receive(self._paused or engine.is_finished()):
                if isinstance(command, AddRequest):
                    self._add(command)
                elif isinstance(command, AbortRequest):
                    self._abort(command)
                elif isinstance(command, EngineCall):
                    self._call(command)
                else:
                    self._end_all()
                    if isinstance(command, Stop):
                        self._flush()
                        return
            if not self._paused and not engine.is_finished():
                self._num_steps += 1
                self._due_interval = -(-len(self._live) // STREAMS_PER_STEP)
                self._dispatch(engine.step_updates(self._due))
            self._flush()

    def _flush(self, stats: dict | None = None) -> None:
        """Send this iteration's items, if any, with the engine's stats."""
        if self._items:
            items, self._items = self._items, []
            self._stats = self.engine.stats() if stats is None else stats
            self.send((items, self._stats))

    def _add(self, command: AddRequest) -> None:
        try:
            self.engine.add_request(command.prompt, command.sampling_params, command.request_id, command.priority)
        except Exception as e:              # bad input: only this caller hears of it
            self._items.append((REFUSED, command.request_id, portable_exception(e)))
            return
        self._live[command.request_id] = _RequestState()
        self._items.append((ACCEPTED, command.request_id))

    def _abort(self, command: AbortRequest) -> None:
        was_live = self.engine.abort(command.request_id)
        state = self._live.pop(command.request_id, None)
        if state is not None:
            self._items.append((OUTPUT, command.request_id, aborted_stream_dict(command.request_id,
                                                                                state.last_index or 0)))
        if command.reply_token is not None:
            self._items.append((ABORTED, command.reply_token, was_live))

    def _call(self, command: EngineCall) -> None:
        try:
            if command.method not in ENGINE_CALLS:
                raise ValueError(f"method: {command.method!r} is not one of {sorted(ENGINE_CALLS)}")
            if command.method == "pause_generation":
                if not self._paused:        # the step in flight finishes now, on the weights it started with
                    self._dispatch(self.engine.step_updates(self._due, drain=True))
                self._paused, value = True, None
            elif command.method == "resume_generation":
                self._paused, value = False, None
            elif command.method == "is_paused":
                value = self._paused
            elif command.method == "weight_version":
                value = self.engine.weight_version
            else:
                value = getattr(self.engine, command.method)(*command.args, **command.kwargs)
        except Exception as e:              # a bad call: only its caller hears of it
            self._items.append((CALLED, command.reply_token, False, portable_exception(e)))
            return
        self._items.append((CALLED, command.reply_token, True, value))

    def _due(self, request_id: Hashable) -> bool:
        """Does this request hear from this step (see the top of this file)?"""
        state = self._live.get(request_id)
        return (state is None or state.last_index is None
                or self._num_steps - state.sent_at_step >= self._due_interval)

    def _dispatch(self, updates: list) -> None:
        for update in updates:
            state = self._live.get(update.request_id)
            if state is None:
                continue
            if update.output is not None:         # the engine's output ends the request
                del self._live[update.request_id]
            state.last_index, state.sent_at_step = update.index, self._num_steps
            self._items.append((OUTPUT, update.request_id, update.stream_dict()))

    def _end_all(self) -> None:
        for request_id in self._live:
            self.engine.abort(request_id)
            self._items.append((CLOSED, request_id))
        self._live.clear()

    def _refuse_until_stop(self, error: BaseException) -> None:
        """After a failure, answer every add with the error until Stop, so nobody waits forever."""
        while True:
            items = []
            for command in self.receive(True):
                if isinstance(command, Stop):
                    return
                if isinstance(command, AddRequest):
                    items.append((REFUSED, command.request_id, error))
                elif isinstance(command, AbortRequest) and command.reply_token is not None:
                    items.append((ABORTED, command.reply_token, False))
                elif isinstance(command, EngineCall):
                    items.append((CALLED, command.reply_token, False, error))
            if items:
                self.send((items, self._stats))


def portable_exception(error: BaseException) -> BaseException:
    """The error itself if it survives pickling (to reach another process), else a RuntimeError
    with its repr."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(repr(error))


def queue_receiver(commands: queue.SimpleQueue) -> Callable[[bool], list[Command]]:
    """`receive` over a queue of commands (the loop on a thread of the frontend's process)."""
    def receive(block: bool) -> list[Command]:
        received = [commands.get()] if block else []
        while True:
            try:
                received.append(commands.get_nowait())
            except queue.Empty:
                return received
    return receive


def pipe_receiver(conn: Connection) -> Callable[[bool], list[Command]]:
    """`receive` over a pipe that carries lists of commands (the loop in the engine process). The
    pipe's end (the frontend's process is gone) reads as Stop."""
    def receive(block: bool) -> list[Command]:
        received = []
        try:
            if block:
                received += conn.recv()
            while conn.poll():
                received += conn.recv()
        except (EOFError, OSError):
            received.append(Stop())
        return received
    return receive


def run_engine_process(model: str, engine_args: dict, commands: Connection, messages: Connection) -> None:
    """The engine process: build the LLMEngine, answer (READY, config, stats) or (FAILED, error), then
    serve until Stop or until the frontend's process goes away, and shut the engine down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the frontend stops us
    from nanovllm.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(model, **engine_args)
    except BaseException as e:
        if not isinstance(e, (ValueError, TypeError)):      # bad arguments explain themselves
            e.add_note("in the engine process:\n" + traceback.format_exc())
        messages.send((FAILED, portable_exception(e)))
        return
    try:
        messages.send((READY, engine.config, engine.stats()))
        EngineLoop(engine, pipe_receiver(commands), messages.send).run()
    except OSError:                         # the frontend's process is gone: nobody to tell
        pass
    finally:
        engine.shutdown()
        messages.close()
