"""The host tier of the prefix cache: which host-memory block holds which evicted prefix block.

A GPU block evicted from the prefix cache is copied here instead of being lost; a later prompt whose
next prefix block is only here gets it copied back. The tier has its own hash index (the same chain
hashes, confirmed by token ids) and its own LRU. It only keeps the books: the copies themselves are
the model runner's (worker/kv_offload.py), which makes them in the order the block manager records.
"""
from collections import OrderedDict, deque


class HostBlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.empty_blocks: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()      # filled blocks, least recently used first
        self.hash_to_block: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}                  # host block -> hash
        self.block_token_ids: dict[int, tuple[int, ...]] = {}
        # blocks a load of the coming step reads: evicting one would overwrite it before it is read
        self.reading: set[int] = set()

    @property
    def num_used_blocks(self) -> int:
        return len(self.lru)

    def find(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None or self.block_token_ids[block_id] != token_ids:
            return None
        return block_id

    def store(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """A host block for an evicted GPU block, or None when none is needed (the tier already has
        it, then it counts as used now) or none can be had (every block is being read)."""
        if block_hash in self.hash_to_block:
            self.lru.move_to_end(self.hash_to_block[block_hash])
            return None
        if self.empty_blocks:
            block_id = self.empty_blocks.popleft()
        else:
            block_id = next((b for b in self.lru if b not in self.reading), None)
            if block_id is None:
                return None
            self._forget(block_id)
        self.hash_to_block[block_hash] = block_id
        self.block_hash[block_id], self.block_token_ids[block_id] = block_hash, token_ids
        self.lru[block_id] = None
        return block_id

    def read(self, block_id: int) -> None:
        """A load of block_id is recorded: it is used now and must survive until the step's copies."""
        self.lru.move_to_end(block_id)
        self.reading.add(block_id)

    def copies_sent(self) -> None:
        """The recorded copies went to the device, in order: nothing is waiting to be read."""
        self.reading.clear()

    def drop(self, block_id: int) -> None:
        """block_id's contents are unknown (a copy into it may not have run): make it empty."""
        if block_id in self.lru:
            self._forget(block_id)
            self.empty_blocks.append(block_id)
        self.reading.discard(block_id)

    def _forget(self, block_id: int) -> None:
        del self.lru[block_id]
        del self.hash_to_block[self.block_hash.pop(block_id)]
        del self.block_token_ids[block_id]
