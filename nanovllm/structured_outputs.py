"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a few
choices, or an EBNF grammar. Checked when made; compiled into token masks by the engine."""
import json
from dataclasses import dataclass


@dataclass(slots=True)
class StructuredOutputsParams:
    json: dict | str | None = None     # a JSON schema (dict or its text)
    json_object: bool = False          # any JSON object
    regex: str | None = None
    choice: list[str] | None = None    # exactly one of these strings
    grammar: str | None = None         # EBNF (GBNF dialect, as xgrammar reads it)
    # Random or weak models loop on optional whitespace inside JSON; vLLM's switch for it.
    disable_any_whitespace: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise TypeError(f"structured_outputs.json must be a dict or a JSON string, got {type(self.json).__name__}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    def key(self) -> tuple:
        """What identifies the compiled grammar (compiled grammars are cached by this)."""
        schema = self.json if isinstance(self.json, str) or self.json is None else json.dumps(self.json, sort_keys=True)
        choice = tuple(self.choice) if self.choice is not None else None
        return (schema, self.json_object, self.regex, choice, self.grammar, self.disable_any_whitespace)
