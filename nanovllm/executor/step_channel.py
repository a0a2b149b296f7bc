"""How a step reaches a worker process without a pickle: rank 0 writes the step's arrays flat into
shared memory of that worker's own, and the pipe carries only a small header (flags and array
shapes; the dtypes are fixed), on which the worker wakes and copies the arrays out. On a CPU
(docs/benchmarks.md) a step is in the worker's hands 18-20 us after rank 0 sends it; pickled, 44-63 us.

The memory is a ring of SLOTS slots, and a semaphore counts the free ones: the worker frees a slot
once it has copied its step out, and rank 0 waits for a free one, watching that the worker lives.
Everything else on the pipe (calls, the stop message, a step too large for a slot) stays pickled;
the first byte of a message tells the two apart. Rank 0 unlinks the memory at shutdown.
"""
import pickle
import struct
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Callable

import numpy as np

from nanovllm.config import Config
from nanovllm.core.step import ShardSampling, StepInputs

SLOTS = 2       # rank 0 may write a step while the worker still copies out the one before
STEP = b"S"     # a header; a pickle starts with b"\x80"
# The int64 arrays of a step in the order they lie in a slot, and whether each is 2-D; with shard
# sampling its seeds follow, then its float32 temperatures (from the next 8-byte word).
ARRAYS = (("input_ids", False), ("positions", False), ("slot_mapping", False), ("context_lens", False),
          ("cu_seqlens_q", False), ("block_tables", True), ("logits_indices", False), ("block_copies", True),
          ("kv_offloads", True), ("kv_loads", True))
# tag, slot, is_prefill, has shard_sampling, num_shared_tokens, number of temperatures, then each
# array's rows and columns (1 for a 1-D array; 0, 0 for the seeds when the step has none)
HEADER = struct.Struct("<cB??qq" + "qq" * (len(ARRAYS) + 1))


def slot_words(config: Config) -> int:
    """Room, in 8-byte words, for the largest step the scheduler makes (tokens, sequences, block
    tables), and 8192 words for block copies and host-tier transfers; a larger step goes pickled."""
    tokens, seqs = config.max_num_batched_tokens, config.max_num_seqs
    return 4 * tokens + 4 * (seqs + 1) + seqs * config.min_kvcache_blocks + 8192


@dataclass
class StepChannel:
    """One worker's ring. Rank 0 makes it (StepChannel.create) and hands it to the process, where
    it unpickles attached to the same memory."""
    memory: SharedMemory
    free_slots: object          # a multiprocessing Semaphore, SLOTS at first
    slot_words: int
    num_sent: int = 0           # rank 0: steps written, so the next one's slot

    def __post_init__(self):
        self.words = np.ndarray(SLOTS * self.slot_words, np.int64, self.memory.buf)

    @classmethod
    def create(cls, context, slot_words: int) -> "StepChannel":
        return cls(SharedMemory(create=True, size=8 * SLOTS * slot_words), context.Semaphore(SLOTS), slot_words)

    def __getstate__(self) -> dict:
        return {"memory": self.memory, "free_slots": self.free_slots, "slot_words": self.slot_words}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # ---- rank 0 ------------------------------------------------------------------------------

    def send(self, conn: Connection, message, check_alive: Callable[[], None]) -> None:
        """Send `message` to the worker: a StepInputs through a slot, anything else pickled."""
        if not isinstance(message, StepInputs):
            conn.send(message)
            return
        arrays = [getattr(message, name) for name, _ in ARRAYS]
        dims = [d for array, (_, two_d) in zip(arrays, ARRAYS) for d in (array.shape if two_d else (len(array), 1))]
        shard = message.shard_sampling
        if shard is not None:
            arrays.append(shard.seeds)
            dims += (len(shard.seeds), 1)
        num_ints = sum(array.size for array in arrays)
        num_temperatures = 0 if shard is None else len(shard.temperatures)
        end = num_ints + (num_temperatures + 1) // 2
        if end > self.slot_words:
            conn.send(message)
            return
        while not self.free_slots.acquire(timeout=0.05):    # the worker has not copied a step out yet
            check_alive()
        slot = self.num_sent % SLOTS
        start = slot * self.slot_words
        try:
            np.concatenate(arrays, axis=None, out=self.words[start:start + num_ints])
            if shard is not None:
                self.words[start + num_ints:start + end].view(np.float32)[:num_temperatures] = shard.temperatures
            conn.send_bytes(HEADER.pack(STEP, slot, message.is_prefill, shard is not None, message.num_shared_tokens,
                                        num_temperatures, *dims, *(() if shard else (0, 0))))
        except BaseException:
            self.free_slots.release()       # the worker never hears of this slot
            raise
        self.num_sent += 1

    def unlink(self) -> None:
        """Close the memory and remove it, and the semaphore (rank 0, once the worker has stopped)."""
        self.close()
        self.memory.unlink()
        self.free_slots = None      # multiprocessing removes a semaphore's name when it is collected

    # ---- the worker ----------------------------------------------------------------------------

    def receive(self, conn: Connection):
        """The next message from rank 0: a StepInputs, or what was pickled (a call, None to stop)."""
        message = conn.recv_bytes()
        if message[:1] != STEP:
            return pickle.loads(message)
        _, slot, is_prefill, sharded, num_shared_tokens, num_temperatures, *dims = HEADER.unpack(message)
        shapes = [(rows, columns) for rows, columns in zip(dims[::2], dims[1::2])]
        num_ints = sum(rows * columns for rows, columns in shapes)
        start = slot * self.slot_words
        data = self.words[start:start + num_ints + (num_temperatures + 1) // 2].copy()   # then the slot is free
        self.free_slots.release()
        arrays, start = {}, 0
        for (name, two_d), (rows, columns) in zip(ARRAYS, shapes):
            array = data[start:start + rows * columns]
            arrays[name] = array.reshape(rows, columns) if two_d else array
            start += rows * columns
        shard = None
        if sharded:
            rows = shapes[-1][0]
            shard = ShardSampling(data[num_ints:].view(np.float32)[:num_temperatures], data[start:start + rows])
        return StepInputs(is_prefill, **arrays, shard_sampling=shard, num_shared_tokens=num_shared_tokens)

    def close(self) -> None:
        del self.words          # the memory cannot close while an array views it
        self.memory.close()
