"""One sequence of a request: its tokens, where it stands, and the KV blocks it holds."""
import time
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, request_id=None):
        self.seq_id = next(Sequence._ids)
        self.request_id = self.seq_id if request_id is None else request_id
        self.token_ids = list(token_ids)  # real ids only: prompt, then every collected token
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        # Row of the in-flight step's sampler output that holds this sequence's next token, which the
        # host has not collected yet (the next step reads it on the device); None when there is none.
        self.pending_row: int | None = None
        self.num_computed_tokens = 0      # tokens whose K/V are in the cache
        self.num_cached_tokens = 0        # prompt tokens served by the prefix cache at first admission
        self.admitted = False
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block, grown as blocks fill
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence holds, the pending one included: what scheduling and K/V sizing count."""
        return len(self.token_ids) + (self.pending_row is not None)

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Add a sampled token (the pending one, if the step that sampled it marked one)."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.pending_row = None
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
