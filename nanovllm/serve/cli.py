"""`nanovllm serve [MODEL] [--host] [--port] [--api-key] [--served-model-name] [tool and reasoning
parsers] [engine arguments]`.

Every engine argument of `nanovllm.config.Config` is a --kebab-case flag; flags not given keep the
engine's defaults. SIGINT/SIGTERM abort the requests in flight, stop the engine and its workers,
and exit with status 0.
"""
import argparse
import contextlib
import json
import signal
import socket
import sys
import typing
from dataclasses import MISSING, fields

import uvicorn

from nanovllm.serve.reasoning_parser import REASONING_PARSERS
from nanovllm.serve.tool_parsers import TOOL_PARSERS

SERVER_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def engine_arg_fields() -> list:
    from nanovllm.config import Config
    return [f for f in fields(Config) if f.init and f.name != "model"]


def _flag_type(field) -> type:
    """int, float, str or bool, from the default or else the `X | None` annotation."""
    if field.default is not None and field.default is not MISSING:
        return type(field.default)
    args = [a for a in typing.get_args(field.type) if a is not type(None)]
    if args and args[0] is dict:
        return _json_object
    return args[0] if args else str


def _json_object(text: str) -> dict:
    """A flag whose value is a JSON object, e.g. --speculative-config '{"method": "ngram", ...}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None,
                        help="checkpoint directory or Hugging Face repo id (default: the bundled demo model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    chat = parser.add_argument_group("tool calls and reasoning")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='serve tool_choice "auto": the model\'s calls become message.tool_calls')
    chat.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                      help="how the model writes its calls (hermes: Qwen's <tool_call> JSON)")
    chat.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                      help="move <think>...</think> into message.reasoning_content")
    parser.add_argument("--enable-rollout-endpoints", action="store_true",
                        help="serve /sleep, /wake_up, /update_weights_from_disk, /pause, ... (docs/rollout.md)")
    engine = parser.add_argument_group("engine arguments (docs/engine_args.md)")
    for field in engine_arg_fields():
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(field)
        if kind is bool:
            engine.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"default: {field.default}")
        else:
            engine.add_argument(flag, dest=field.name, type=kind, default=argparse.SUPPRESS,
                                help=f"default: {field.default}")
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    """The server's options and the engine arguments that were given."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    engine_args = {f.name: getattr(args, f.name) for f in engine_arg_fields() if hasattr(args, f.name)}
    return args, engine_args


class GracefulServer(uvicorn.Server):
    """uvicorn, plus: shutting down first aborts the engine's requests, so that open streams end at
    once instead of holding the shutdown; and a SIGINT/SIGTERM that stopped the server is not
    re-raised afterwards (uvicorn does), so that the exit status is 0."""

    def __init__(self, config: uvicorn.Config, on_shutdown: typing.Callable[[], None]):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SERVER_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        self.on_shutdown()
        await super().shutdown(sockets)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, listening before the engine loads: a port already taken fails at once
    instead of after the weights load, and no other process can take it meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        sys.exit(f"nanovllm serve: --host {host} --port {port}: {e.strerror or e}")
    return sock


def main(argv: list[str] | None = None) -> None:
    args, engine_args = parse_args(argv)
    sock = listening_socket(args.host, args.port)
    try:
        serve(args, engine_args, sock)
    finally:
        sock.close()


def serve(args: argparse.Namespace, engine_args: dict, sock: socket.socket) -> None:
    model = args.model
    if model is None:
        from nanovllm import demo          # imported here: only needed without MODEL
        model = demo.model_path()
    from nanovllm.async_llm import AsyncLLM
    from nanovllm.serve.app import build_app
    try:
        llm = AsyncLLM(model, **engine_args)
    except (ValueError, TypeError) as e:
        sys.exit(f"nanovllm serve: {e}")
    try:
        app = build_app(llm, args.served_model_name or args.model or "nanovllm-demo", args.api_key,
                        args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser,
                        args.enable_rollout_endpoints)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=10)
        GracefulServer(config, on_shutdown=llm.abort_all).run(sockets=[sock])
    finally:
        llm.shutdown()


def console() -> None:
    """The `nanovllm` command; `serve` is its one subcommand."""
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        sys.exit("usage: nanovllm serve [MODEL] [options]   (nanovllm serve --help for the options)")
    main(sys.argv[2:])
