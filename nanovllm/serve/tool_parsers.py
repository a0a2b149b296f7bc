"""Tool calls in a model's output, parsed as its text arrives: `--tool-call-parser hermes|llama3_json`
for `tool_choice: "auto"`, and the outputs the server constrains for `"required"` and a named function.

Every parser is fed the output's text piece by piece (`feed`), then told it ended (`finish`); each
answers a ToolDelta: new `content` text and OpenAI's `delta.tool_calls` pieces (a call's index, id,
type and name in its first piece, then pieces of its arguments). A call's arguments are the JSON text
the model wrote for them, so a stream's pieces join to exactly what parsing the whole text gives.
Text that does not turn out to be a call (a broken call object, say) stays content.
"""
import json
import uuid
from dataclasses import dataclass, field

from nanovllm.serve.reasoning_parser import partial_tag_length

WHITESPACE = frozenset(" \t\r\n")
SCALAR_CHARS = frozenset("-+.0123456789eEtrufalsn")       # numbers, true, false, null
OUTSIDE_STRING_CHARS = frozenset("{}[],:") | WHITESPACE | SCALAR_CHARS


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallObjectScanner:
    """Reads one JSON object that holds a call, {"name": ..., <arguments key>: ...}, as its text
    arrives: the name once its string is complete, the arguments' text as it comes (held back
    while the name is still unknown). A string given as the arguments counts as their JSON text."""

    def __init__(self, arguments_keys: tuple[str, ...]):
        self.arguments_keys = arguments_keys
        self.expect = "object"          # object, key, colon, value, comma (what comes next at the top)
        self.in_string = self.escaped = False
        self.key_text = ""              # the JSON text of the key being read, then of the last key
        self.value_kind = None          # while a value is read: container, string or scalar
        self.value_text = ""
        self.value_depth = 0            # brackets open inside a container value
        self.streaming = False          # the value being read is the arguments
        self.name = None
        self.has_arguments = False
        self.held_arguments = ""        # arguments read before the name
        self.done = self.malformed = False
        self._name_out, self._arguments_out = None, []

    def feed(self, text: str) -> tuple[str | None, str, int]:
        """(the name if it completed in this text, new arguments text, characters read). Reading
        stops after the object's closing brace, or before a character that breaks it (malformed)."""
        self._name_out, self._arguments_out = None, []
        read = len(text)
        for position, char in enumerate(text):
            self._read(char)
            if self.malformed or self.done:
                read = position + self.done
                break
        return self._name_out, "".join(self._arguments_out), read

    def _read(self, char: str) -> None:
        if self.value_kind is not None:
            self._read_value(char)
        elif self.in_string:                            # a key
            self.key_text += char
            self._track_string(char)
            if not self.in_string:
                self.expect = "colon"
        elif char in WHITESPACE:
            pass
        elif self.expect == "object":
            self._expect(char == "{", "key")
        elif self.expect == "key" and char == '"':
            self.key_text, self.in_string = char, True
        elif self.expect in ("key", "comma") and char == "}":
            self._close()
        elif self.expect == "comma":
            self._expect(char == ",", "key")
        elif self.expect == "colon":
            self._expect(char == ":", "value")
        elif self.expect == "value":
            self._start_value(char)
        else:
            self.malformed = True

    def _expect(self, ok: bool, then: str) -> None:
        self.malformed = not ok
        self.expect = then

    def _track_string(self, char: str) -> None:
        if self.escaped:
            self.escaped = False
        elif char == "\\":
            self.escaped = True
        elif char == '"':
            self.in_string = False

    def _start_value(self, char: str) -> None:
        if char in "{[":
            self.value_kind, self.value_depth = "container", 1
        elif char == '"':
            self.value_kind, self.in_string = "string", True
        elif char in SCALAR_CHARS:
            self.value_kind = "scalar"
        else:
            self.malformed = True
            return
        self.value_text = char
        self.streaming = self._key() in self.arguments_keys and not self.has_arguments
        if self.streaming:
            self.has_arguments = True
            if self.value_kind == "container":
                self._emit(char)

    def _read_value(self, char: str) -> None:
        if self.value_kind == "scalar":
            if char in SCALAR_CHARS:
                self.value_text += char
            else:                               # the scalar ended; the char belongs to the object
                self._end_value()
                self._read(char)
            return
        if self.in_string:
            self._track_string(char)
        elif self.value_kind == "string":
            pass
        elif char not in OUTSIDE_STRING_CHARS and char != '"':
            self.malformed = True
            return
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.value_depth += 1
        elif char in "}]":
            self.value_depth -= 1
        self.value_text += char
        if self.streaming and self.value_kind == "container":
            self._emit(char)
        if not self.in_string and (self.value_kind == "string" or self.value_depth == 0):
            self._end_value()

    def _end_value(self) -> None:
        kind, text = self.value_kind, self.value_text
        self.value_kind, self.value_text, self.expect = None, "", "comma"
        if self._key() == "name":
            name = _json_or_none(text)
            if not isinstance(name, str) or self.name is not None:
                self.malformed = True
                return
            self.name = self._name_out = name
            self._emit(self.held_arguments)
            self.held_arguments = ""
        elif self.streaming and kind != "container":
            decoded = _json_or_none(text) if kind == "string" else text
            self._emit(decoded if isinstance(decoded, str) else text)
        self.streaming = False

    def _close(self) -> None:
        if self.name is None:
            self.malformed = True
            return
        self.done = True
        if not self.has_arguments:
            self._emit("{}")

    def _key(self) -> str | None:
        return _json_or_none(self.key_text)

    def _emit(self, arguments: str) -> None:
        if self.name is None:
            self.held_arguments += arguments
        elif arguments:
            self._arguments_out.append(arguments)


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolParser:
    """What every parser shares: numbering the calls it finds, as OpenAI's delta pieces."""

    def __init__(self):
        self.num_calls = 0

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        raise NotImplementedError

    def _call_pieces(self, name: str | None, arguments: str) -> list[dict]:
        """A new call's first piece when name is given, else the current call's next arguments."""
        if name is not None:
            self.num_calls += 1
            return [{"index": self.num_calls - 1, "id": new_call_id(), "type": "function",
                     "function": {"name": name, "arguments": arguments}}]
        return [{"index": self.num_calls - 1, "function": {"arguments": arguments}}] if arguments else []


class HermesToolParser(ToolParser):
    """Qwen's and Hermes's calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
    any number of them, after optional content. Whitespace between and after the blocks is dropped."""
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.state = "text"             # text, call (inside a block's object), after_call (until its end tag)
        self.pending = ""               # text not yet settled
        self.block_text = ""            # the block read so far while its call has no name (content if broken)
        self.between = ""               # whitespace after a call: dropped if another call or the end follows
        self.scanner = None

    def feed(self, text: str) -> ToolDelta:
        self.pending += text
        out = ToolDelta()
        while self.pending:
            if self.state == "text":
                found = self.pending.find(self.START)
                if found < 0:
                    settled = len(self.pending) - partial_tag_length(self.pending, self.START)
                    self._content(self.pending[:settled], out)
                    self.pending = self.pending[settled:]
                    break
                self._content(self.pending[:found], out)
                self.between = ""
                self.pending = self.pending[found + len(self.START):]
                self.state, self.block_text = "call", self.START
                self.scanner = CallObjectScanner(("arguments",))
            elif self.state == "call":
                if not self._read_call(out):
                    break
            else:
                found = self.pending.find(self.END)
                if found < 0:
                    self.pending = self.pending[len(self.pending) - partial_tag_length(self.pending, self.END):]
                    break
                self.pending = self.pending[found + len(self.END):]
                self.state = "text"
        return out

    def _read_call(self, out: ToolDelta) -> bool:
        """Read the pending text into the block's call object; False when it needs more text."""
        name, arguments, read = self.scanner.feed(self.pending)
        out.tool_calls += self._call_pieces(name, arguments)
        self.block_text += self.pending[:read]
        self.pending = self.pending[read:]
        if self.scanner.malformed and self.scanner.name is None:       # no call after all
            out.content += self.block_text
            self.state = "text"
        elif self.scanner.malformed or self.scanner.done:
            self.state = "after_call"
        else:
            return False
        return True

    def _content(self, text: str, out: ToolDelta) -> None:
        if self.num_calls == 0 or self.between.strip():
            out.content += text
            return
        self.between += text
        if self.between.strip():
            out.content += self.between

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.state == "text":
            self._content(self.pending, out)
        elif self.state == "call" and self.scanner.name is None:
            out.content = self.block_text + self.pending
        self.pending = ""
        return out


class JsonCallListParser(ToolParser):
    """Calls written as JSON objects one after another: after an opening text (required unless the
    first object may begin the output), objects {"name": ..., <arguments key>: ...} separated by
    `separator`, up to an optional closing text. An output that does not begin so is content."""

    def __init__(self, opening: str, opening_required: bool, separator: str, closing: str | None,
                 arguments_keys: tuple[str, ...]):
        super().__init__()
        self.opening, self.opening_required = opening, opening_required
        self.separator, self.closing = separator, closing
        self.arguments_keys = arguments_keys
        self.state = "start"            # start, call, between (after a call), text, end
        self.pending = ""
        self.call_text = ""             # the call object read so far while it has no name
        self.scanner = None

    def feed(self, text: str) -> ToolDelta:
        self.pending += text
        out = ToolDelta()
        while self.pending:
            if self.state == "start":
                rest = self.pending.lstrip()
                if not rest or (len(rest) < len(self.opening) and self.opening.startswith(rest)):
                    break
                if rest.startswith(self.opening):
                    self.pending = rest[len(self.opening):]
                    self._start_call()
                elif rest[0] == "{" and not self.opening_required:
                    self.pending = rest
                    self._start_call()
                else:
                    self.state = "text"
            elif self.state == "call":
                name, arguments, read = self.scanner.feed(self.pending)
                out.tool_calls += self._call_pieces(name, arguments)
                self.call_text += self.pending[:read]
                self.pending = self.pending[read:]
                if self.scanner.malformed:
                    out.content += self.call_text if self.scanner.name is None else ""
                    self.state = "text"
                elif self.scanner.done:
                    self.state = "between"
                else:
                    break
            elif self.state == "between":
                rest = self.pending.lstrip()
                if rest.startswith(self.separator):
                    self.pending = rest[len(self.separator):]
                    self._start_call()
                elif self.closing is not None and rest.startswith(self.closing):
                    self.pending, self.state = "", "end"
                elif rest:
                    self.pending, self.state = rest, "text"
                else:
                    self.pending = ""
            elif self.state == "text":
                out.content += self.pending
                self.pending = ""
            else:
                self.pending = ""
        return out

    def _start_call(self) -> None:
        self.state, self.call_text = "call", ""
        self.scanner = CallObjectScanner(self.arguments_keys)

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self.state in ("start", "text"):
            out.content = self.pending
        elif self.state == "call" and self.scanner.name is None:
            out.content = self.call_text + self.pending
        self.pending = ""
        return out


class NamedCallParser(ToolParser):
    """`tool_choice` naming a function: the whole output is that call's arguments."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> ToolDelta:
        return ToolDelta(tool_calls=self._call_pieces(None if self.num_calls else self.name, text))

    def finish(self) -> ToolDelta:
        return self.feed("") if self.num_calls == 0 else ToolDelta()


def hermes() -> ToolParser:
    return HermesToolParser()


def llama3_json() -> ToolParser:
    """Llama 3's JSON calls: {"name": ..., "parameters": {...}}, after an optional <|python_tag|>,
    several separated by `;`."""
    return JsonCallListParser("<|python_tag|>", False, ";", None, ("parameters", "arguments"))


def required_calls() -> ToolParser:
    """`tool_choice: "required"`: the output is a JSON array of {"name": ..., "parameters": {...}}."""
    return JsonCallListParser("[", True, ",", "]", ("parameters",))


TOOL_PARSERS = {"hermes": hermes, "llama3_json": llama3_json}
