"""How one request is sampled and when it stops; checked when it is made."""
from dataclasses import dataclass

from nanovllm.structured_outputs import StructuredOutputsParams
from nanovllm.utils.validation import check_int, check_number

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5   # temperatures under this are greedy (as in vLLM): dividing by them overflows


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                         # independent completions of the prompt
    temperature: float = 1.0           # 0 means greedy
    top_k: int = -1                    # -1 or 0: off
    top_p: float = 1.0                 # 1.0: off
    min_p: float = 0.0                 # 0: off
    seed: int | None = None            # per-request noise seed, reproducible
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None        # chosen token's logprob plus this many top alternatives
    prompt_logprobs: int | None = None  # each prompt token's logprob plus this many top alternatives
    structured_outputs: StructuredOutputsParams | None = None   # the output must match this

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field (again: the engine calls this when a request is added, since fields can
        be changed after construction) and normalise stop, stop_token_ids and tiny temperatures."""
        check_int("n", self.n, low=1)
        check_number("temperature", self.temperature, low=0.0)
        check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_number("min_p", self.min_p, low=0.0, high=1.0)
        check_int("top_k", self.top_k, low=-1)
        check_int("max_tokens", self.max_tokens, low=1)
        check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        if self.seed is not None:
            check_int("seed", self.seed, low=0)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop
        stop_ids = list(self.stop_token_ids or [])
        for token_id in stop_ids:
            check_int("stop_token_ids", token_id, low=0)
        self.stop_token_ids = stop_ids
        self.temperature = float(self.temperature) if self.temperature >= GREEDY_BELOW else 0.0
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError("structured_outputs must be a StructuredOutputsParams, "
                                f"got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search as vLLM does it: at each step every live beam proposes its 2 * beam_width most
    likely next tokens; candidates ending in EOS finish, the best beam_width others live on."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        check_int("beam_width", self.beam_width, low=1, high=MAX_LOGPROBS // 2)
        check_int("max_tokens", self.max_tokens, low=1)
        check_number("length_penalty", self.length_penalty, low=float("-inf"))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
