"""One request: its tokens, where it stands, and the KV blocks it holds."""
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

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams):
        self.seq_id = next(Sequence._ids)
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0      # tokens whose K/V are in the cache
        self.num_cached_tokens = 0        # prompt tokens served by the prefix cache at first admission
        self.admitted = False
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hash of each full block, grown as blocks fill
        self.finish_reason: str | None = None
        self.text: str | None = None      # set only when a stop string cut the output
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.add_pending_token(0)
        self.set_last_token(token_id, logprobs)

    def add_pending_token(self, row: int) -> None:
        """Hold the place of a token the device is still sampling; the value -1 - row says which
        row of that step's sampler output holds it, so the next step can read it on the device."""
        self.token_ids.append(-1 - row)

    def set_last_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.token_ids[-1] = token_id
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
